"""Segment inventory against real processes that create, map, unlink and leak segments."""
import os
import subprocess
import time


from exporter.collectors.segments import SegmentsCollector
from exporter.model.summary import owner_comm
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from tests.helpers import Runs
from tests.conftest import (EVERY_FAMILY, HOST_EXCUSED_RE, Exporter, Peer, fallocate, mounted_tmpfs, needs_root,
                            select, value)

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1 << 20

pytestmark = needs_root


def inventory(tmpfs):
    inv = Runs(SegmentsCollector(Paths(), ignore_unreadable=HOST_EXCUSED_RE), [tmpfs]).full()
    return inv, inv.mounts[0]


def find(mount_inv, name):
    found = [s for s in mount_inv.rows() if s.name == name]
    assert len(found) == 1, f"{name}: {[(s.name, s.state) for s in mount_inv.rows()]}"
    return found[0]


def test_python_shared_memory_is_linked_and_owned(tmpfs):
    with Peer(tmpfs, "psm", str(2 * MiB)) as peer:
        inv, m = inventory(tmpfs)
        seg = find(m, peer.info)
        assert (seg.cls, seg.state) == ("python_shm", "linked")
        assert seg.allocated_bytes == seg.apparent_bytes == 2 * MiB
        assert seg.holders == (peer.pid,)
        assert owner_comm(seg.holders, inv.comms) == peer.comm
        assert m.process_bytes[peer.pid] == 2 * MiB


def test_mapped_nccl_segment_in_another_mount_namespace(tmpfs):
    # The peer sees /dev/shm/nccl-...; we see <tmpfs>/nccl-...: matched by device and inode.
    with Peer(tmpfs, "mapped", "nccl-Ab12Cd", str(4 * MiB)) as peer:
        _, m = inventory(tmpfs)
        seg = find(m, "nccl-Ab12Cd")
        assert (seg.cls, seg.state, seg.allocated_bytes, seg.holders) == ("nccl", "linked", 4 * MiB, (peer.pid,))


def test_unlinked_but_mapped_is_hidden_with_its_real_size(tmpfs):
    with Peer(tmpfs, "hidden", "nccl-Hid3en", str(3 * MiB)) as peer:
        assert "nccl-Hid3en" not in os.listdir(tmpfs)  # invisible to ls ...
        _, m = inventory(tmpfs)
        seg = find(m, "nccl-Hid3en")  # ... but found through /proc/<pid>/maps
        assert (seg.cls, seg.state, seg.holders) == ("nccl", "hidden", (peer.pid,))
        assert seg.allocated_bytes == 3 * MiB
        assert m.unattributed_bytes <= 4 * PAGE


def test_hidden_partial_mapping_reports_the_allocation_not_the_extent(tmpfs):
    """A segment mapped only in part, sparse beyond its first MiB, then unlinked: only
    /proc/<pid>/map_files (readable as root) gives its real size; maps gives the extent."""
    assert os.geteuid() == 0, "map_files needs CAP_SYS_ADMIN"
    with Peer(tmpfs, "partial", "nccl-Part1al", str(8 * MiB), str(MiB), str(4 * MiB)) as peer:
        _, m = inventory(tmpfs)
        seg = find(m, "nccl-Part1al")
        assert (seg.state, seg.holders) == ("hidden", (peer.pid,))
        assert seg.allocated_bytes == MiB  # not the 4 MiB mapping extent
        assert seg.apparent_bytes == 8 * MiB
        assert m.unattributed_bytes <= 4 * PAGE


def test_unlinked_fd_only_is_hidden(tmpfs):
    with Peer(tmpfs, "fdonly", "torch_123_456", str(MiB)) as peer:
        _, m = inventory(tmpfs)
        seg = find(m, "torch_123_456")
        assert (seg.cls, seg.state, seg.allocated_bytes, seg.holders) == ("torch", "hidden", MiB, (peer.pid,))


def test_leaked_segment_is_orphan_with_age(tmpfs):
    with Peer(tmpfs, "leak", str(MiB)) as peer:
        peer.proc.wait(10)
    name = peer.info
    hour_ago = time.time() - 3600
    os.utime(os.path.join(tmpfs, name), (hour_ago, hour_ago))
    _, m = inventory(tmpfs)
    seg = find(m, name)
    assert (seg.cls, seg.state, seg.allocated_bytes, seg.holders) == ("python_shm", "orphan", MiB, ())
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu") as exporter:
        samples = exporter.scrape()
    age = value(samples, "shmwatch_orphan_oldest_age_seconds", mount=tmpfs)
    assert 3600 <= age < 3700
    assert value(samples, "shmwatch_segments", mount=tmpfs, **{"class": "python_shm", "state": "orphan"}) == 1


def test_sparse_segment_apparent_versus_allocated(tmpfs):
    with Peer(tmpfs, "sparse", "vllm_offload_kv.mmap", str(8 * MiB)):
        _, m = inventory(tmpfs)
        seg = find(m, "vllm_offload_kv.mmap")
        assert seg.cls == "vllm_offload" and seg.apparent_bytes == 8 * MiB and seg.allocated_bytes == 0


def test_hard_links_count_once(tmpfs):
    fallocate(os.path.join(tmpfs, "psm_one"), MiB)
    os.link(os.path.join(tmpfs, "psm_one"), os.path.join(tmpfs, "psm_two"))
    _, m = inventory(tmpfs)
    [seg] = m.rows()
    assert seg.allocated_bytes == MiB


def test_accounting_adds_up(tmpfs):
    """statvfs used == linked + orphan + hidden + unattributed, and unattributed ~ 0."""
    with Peer(tmpfs, "psm", str(2 * MiB)), Peer(tmpfs, "hidden", "nccl-aaaaaa", str(3 * MiB)), \
            Peer(tmpfs, "mapped", "nccl-bbbbbb", str(MiB)), Peer(tmpfs, "fdonly", "torch_1_2", str(MiB)):
        with Peer(tmpfs, "leak", str(MiB)) as leak:
            leak.proc.wait(10)
        _, m = inventory(tmpfs)
        st = os.statvfs(tmpfs)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        by_state = {}
        for seg in m.rows():
            by_state[seg.state] = by_state.get(seg.state, 0) + seg.allocated_bytes
        assert by_state == {"linked": 3 * MiB, "hidden": 4 * MiB, "orphan": MiB}
        assert abs(used - sum(by_state.values()) - m.unattributed_bytes) <= 4 * PAGE
        assert m.unattributed_bytes <= 4 * PAGE


def test_scrape_shows_owner_and_top_segments(tmpfs):
    with Peer(tmpfs, "mapped", "nccl-T0pSeg", str(4 * MiB)) as peer:
        hour_ago = time.time() - 3600  # long-lived: named
        os.utime(os.path.join(tmpfs, "nccl-T0pSeg"), (hour_ago, hour_ago))
        with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", EVERY_FAMILY) as exporter:
            samples = exporter.scrape()
        # The holder by its name (comm), never its pid: a series per restart.
        assert value(samples, "shmwatch_top_segment_bytes", mount=tmpfs, name="nccl-T0pSeg", state="linked",
                     owner=peer.comm, **{"class": "nccl"}) == 4 * MiB
        assert value(samples, "shmwatch_process_shm_bytes", mount=tmpfs, comm=peer.comm) == 4 * MiB
        assert not [labels for labels, _ in select(samples, "shmwatch_process_shm_bytes") if "pid" in labels]
        assert value(samples, "shmwatch_segment_bytes", mount=tmpfs, state="linked", **{"class": "nccl"}) == 4 * MiB


def test_a_segment_made_while_proc_is_read_is_never_called_leaked_before_it_is_walked(tmpfs):
    """A full run lists the directory, then reads /proc. A segment made in between is not in
    that run's listing; the quick run for its event takes it as its creator's (linked), and
    only the next full run, which walks it before reading /proc, may call it leaked."""
    collector = SegmentsCollector(Paths(), ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [tmpfs])
    fallocate(os.path.join(tmpfs, "psm_before"), MiB)  # held by nobody: orphan, owners complete
    runs.full()
    scan = collector.owner_scan.scan

    def made_during_the_read(*args, **kwargs):
        fallocate(os.path.join(tmpfs, "psm_during"), MiB)  # made and closed: nobody holds it
        runs.changed(tmpfs, "psm_during")  # what the watcher tells the scheduler
        return scan(*args, **kwargs)

    collector.owner_scan.scan = made_during_the_read
    full = runs.full()
    collector.owner_scan.scan = scan
    assert find(full.mounts[0], "psm_before").state == "orphan"  # every process was read ...
    assert "psm_during" not in {s.name for s in full.mounts[0].rows()}  # ... but it was not listed
    assert find(runs.quick().mounts[0], "psm_during").state == "linked"
    assert find(runs.full().mounts[0], "psm_during").state == "orphan"  # walked, then /proc


def test_quick_inventory_patches_only_what_inotify_reported(tmpfs):
    runs = Runs(SegmentsCollector(Paths(), ignore_unreadable=HOST_EXCUSED_RE), [tmpfs])
    for name in ("nccl-aaaaaa", "psm_keep", "psm_gone"):
        fallocate(os.path.join(tmpfs, name), MiB)
    runs.full()
    fallocate(os.path.join(tmpfs, "nccl-new000"), 2 * MiB)      # reported
    os.unlink(os.path.join(tmpfs, "psm_gone"))                    # reported
    os.rename(os.path.join(tmpfs, "nccl-aaaaaa"), os.path.join(tmpfs, "torch_1_2"))  # reported (both names)
    with open(os.path.join(tmpfs, "psm_keep"), "ab") as f:        # reported: it grew
        f.write(b"\1" * MiB)
    fallocate(os.path.join(tmpfs, "psm_unreported"), MiB)        # not reported
    for name in ("nccl-new000", "psm_gone", "nccl-aaaaaa", "torch_1_2", "psm_keep"):
        runs.changed(tmpfs, name)
    quick = {s.name: s.allocated_bytes for s in runs.quick().mounts[0].rows()}
    assert quick == {"nccl-new000": 2 * MiB, "torch_1_2": MiB, "psm_keep": 2 * MiB}  # no re-list: no psm_unreported
    full = {s.name: s.allocated_bytes for s in runs.full().mounts[0].rows()}
    assert full == {**quick, "psm_unreported": MiB}
    runs.changed(tmpfs)  # e.g. a directory appeared: the quick run re-lists
    fallocate(os.path.join(tmpfs, "psm_other"), MiB)
    assert "psm_other" in {s.name for s in runs.quick().mounts[0].rows()}


@needs_root
def test_a_quick_run_looks_only_at_the_mounts_inotify_named():
    """Its cost follows the change, not the node's 200 mounts: a mount nothing was said about
    is handed back as the last run left it (unmounted meanwhile, the next full run says so)."""
    with mounted_tmpfs() as a, mounted_tmpfs() as b:
        runs = Runs(SegmentsCollector(Paths(), ProcessTable(Paths())), [a, b])
        before = {m.mount: m for m in runs.full().mounts}
        subprocess.run(["umount", "-l", b], check=True)
        open(os.path.join(a, "psm_new"), "wb").close()
        runs.changed(a, "psm_new")
        quick = {m.mount: m for m in runs.quick().mounts}
        assert quick[b] is before[b]
        assert "psm_new" in {s.name for s in quick[a].rows()}
        assert {m.mount: m.error for m in runs.full().mounts}[b] == "not a mount point"
