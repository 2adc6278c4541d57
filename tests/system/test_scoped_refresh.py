"""Node mode: an event lists the new segment at once (its creator's until read); the next
inventory run reads the pods whose mounts moved, and what other pods' processes hold carries
over from the last full scan (never turned orphan)."""

import os
import subprocess
import sys
import threading
import uuid

import pytest

from exporter.collectors.segments import SegmentsCollector
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from exporter.runtime.scheduler import Sampler
from tests.conftest import HOST_EXCUSED_RE, Peer, mounted_tmpfs, needs_root, prerequisite_missing, remove_cgroup
from tests.helpers import V1_MEMORY, WRITE_IN_PLACE, Clock, MiB, Runs, into_pod, orphan_attached_later, segment


@needs_root
def test_an_event_lists_the_segment_and_the_refresh_reads_only_the_pods_that_moved(tmp_path):
    if not os.path.exists(os.path.join(V1_MEMORY, "cgroup.procs")):
        prerequisite_missing(f"needs the cgroup v1 memory controller at {V1_MEMORY} to put processes in pod cgroups")
    uid_a, uid_b = str(uuid.uuid4()), str(uuid.uuid4())
    cgroups = {uid: os.path.join(V1_MEMORY, "kubepods", "burstable", f"pod{uid}") for uid in (uid_a, uid_b)}
    mount = {uid: f"{tmp_path}/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm"
             for uid in (uid_a, uid_b)}
    for path in cgroups.values():
        os.makedirs(path)
    try:
        with mounted_tmpfs("16m", path=mount[uid_a]) as a, mounted_tmpfs("16m", path=mount[uid_b]) as b, \
                Peer(a, "mapped", "nccl-a", str(MiB)) as pa, Peer(b, "mapped", "nccl-b", str(MiB)) as pb:
            into_pod(cgroups[uid_a], pa.pid)
            into_pod(cgroups[uid_b], pb.pid)
            clock = Clock()
            collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                          full_scan_interval=120.0, monotonic=clock,
                                          ignore_unreadable=HOST_EXCUSED_RE)
            runs = Runs(collector, [a, b])
            inv = runs.full()
            assert segment(inv, a, "nccl-a") == ("linked", (pa.pid,))
            assert segment(inv, b, "nccl-b") == ("linked", (pb.pid,))
            b_before = next(m for m in inv.mounts if m.mount == b)
            scanned_at = collector.pace.scanned_at
            with Peer(a, "mapped", "nccl-a2", str(MiB)) as pa2:
                into_pod(cgroups[uid_a], pa2.pid)
                runs.changed(a, "nccl-a2")  # what the watcher records for a create in pod A's mount
                inv = runs.quick()
                # Listed at once, taken as its creator's: nobody was read for it.
                assert segment(inv, a, "nccl-a2") == ("linked", ())
                assert segment(inv, a, "nccl-a") == ("linked", (pa.pid,))
                assert next(m for m in inv.mounts if m.mount == b) is b_before  # not assembled again
                clock.now += 15
                inv = runs.full()  # the inventory run: a refresh, not a full scan
                assert collector.pace.scanned_at == scanned_at
                assert segment(inv, a, "nccl-a2") == ("linked", (pa2.pid,))
                assert segment(inv, a, "nccl-a") == ("linked", (pa.pid,))
                assert segment(inv, b, "nccl-b") == ("linked", (pb.pid,))  # carried over
                assert inv.pods[pa2.pid] == uid_a and inv.pods[pb.pid] == uid_b
    finally:
        for path in cgroups.values():
            remove_cgroup(path)
        for parent in ("kubepods/burstable", "kubepods"):
            try:
                os.rmdir(os.path.join(V1_MEMORY, parent))
            except OSError:
                pass


@needs_root
def test_a_change_outside_any_pod_is_left_to_the_full_follow_up(tmp_path):
    """No pod to scope to: the quick run reads nobody, and takes the new segment as its
    creator's until the full run that follows it reads every process."""
    with mounted_tmpfs("16m") as shm:  # not a kubelet path
        collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True)
        runs = Runs(collector, [shm])
        runs.full()
        open(os.path.join(shm, "psm_x"), "wb").close()
        runs.changed(shm, "psm_x")
        assert segment(runs.quick(), shm, "psm_x") == ("linked", ())
        assert segment(runs.full(), shm, "psm_x")[0] in ("orphan", "unverified")


def killed(peer):
    """SIGKILL: the peer dies holding its segment and never unlinks it (a crashed engine)."""
    peer.proc.kill()
    peer.proc.wait()


@needs_root
def test_between_full_scans_a_refresh_reads_new_processes_and_the_pods_of_exited_holders(two_pods):
    (a, b), (cg_a, cg_b) = two_pods
    clock = Clock()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  full_scan_interval=120.0, monotonic=clock, ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [a, b])
    with Peer(a, "mapped", "nccl-a", str(MiB)) as pa, Peer(b, "mapped", "nccl-b", str(MiB)) as pb:
        into_pod(cg_a, pa.pid)
        into_pod(cg_b, pb.pid)
        inv = runs.full()  # the full scan
        assert segment(inv, a, "nccl-a") == ("linked", (pa.pid,))
        with Peer(b, "hidden", "nccl-b2", str(MiB)) as pb2:
            into_pod(cg_b, pb2.pid)
            killed(pa)
            clock.now += 60
            inv = runs.full()  # a refresh: no event told of either
            # A process started since is read: the segment it hides is found.
            assert segment(inv, b, "nccl-b2") == ("hidden", (pb2.pid,))
            # The holder that died left its segment held by nobody in its pod, which was read
            # again; but only a full scan, with every process read, may call it leaked.
            assert segment(inv, a, "nccl-a") == ("unverified", ())
            assert segment(inv, b, "nccl-b") == ("linked", (pb.pid,))  # carried over
            # A leak left since the full scan: new, so taken as its creator's until the full
            # scan reads every process (a refresh reads no pod per create).
            with open(os.path.join(b, "psm_left"), "wb") as f:
                f.write(b"x" * 4096)
            inv = runs.full()
            assert segment(inv, b, "psm_left") == ("linked", ())
            clock.now += 61  # the full scan is due
            inv = runs.full()
            assert segment(inv, a, "nccl-a") == ("orphan", ())
            assert segment(inv, b, "psm_left") == ("orphan", ())
            assert segment(inv, b, "nccl-b2") == ("hidden", (pb2.pid,))
            assert inv.pods[pb2.pid] == os.path.basename(cg_b)[3:]


@needs_root
def test_a_holder_outside_any_pod_that_exits_brings_the_full_scan_forward(two_pods):
    """Its segment may be held by anyone on the node: no pod to read again instead."""
    (a, _), _ = two_pods
    clock = Clock()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  full_scan_interval=120.0, monotonic=clock, ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [a])
    with Peer(a, "mapped", "nccl-host", str(MiB)) as host_process:  # left in the host's cgroups
        assert segment(runs.full(), a, "nccl-host") == ("linked", (host_process.pid,))
        killed(host_process)
        clock.now += 1
        assert segment(runs.full(), a, "nccl-host") == ("orphan", ())


@needs_root
def test_a_refresh_forgets_the_mount_ids_of_a_namespace_whose_last_process_exited(two_pods):
    """Mount IDs and namespace inodes are handed out again once freed: a stale one could
    name a FUSE mount, whose files an fd check must never stat."""
    (a, _), (cg_a, _) = two_pods
    clock = Clock()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  full_scan_interval=120.0, monotonic=clock, ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [a])
    ids = collector.owner_scan._mount_ids
    with Peer(a, "fdonly", "torch_1", str(MiB)) as peer:  # a mount namespace of its own
        into_pod(cg_a, peer.pid)
        runs.full()
        namespace = os.readlink(f"/proc/{peer.pid}/ns/mnt")
        watched = ids._ns_mounts[namespace].watched
        assert watched and watched <= ids.union
        gone, gone_all = set(watched), set(ids._ns_mounts[namespace].ids)
    clock.now += 1
    runs.full()
    assert namespace not in ids._ns_mounts
    others = set().union(*(found.watched for found in ids._ns_mounts.values()))
    assert ids.union == others and gone and not gone & ids.union
    assert not gone_all & ids.mounted_ids  # (what tells a memfd from a file on a mount)


@needs_root
def test_a_refresh_sees_what_changed_with_and_without_events(two_pods):
    """Between full scans, a refresh lists every directory again: pages written through a
    mapping (no event), renames (with an event, or with it still on its way), a tmpfs mounted
    over a volume; a holder outside any pod that exited brings a full scan forward."""
    import mmap

    (a, b), _ = two_pods
    clock = Clock()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  full_scan_interval=600.0, monotonic=clock, ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [a, b])

    def names():
        clock.now += 15
        inv = runs.full()
        return inv, {s.name for m in inv.mounts for s in m.rows()}

    with open(os.path.join(a, "psm_grows"), "wb+") as f, open(os.path.join(b, "psm_b"), "wb") as g:
        f.truncate(4 * MiB)  # sparse: no pages yet
        g.write(b"x" * MiB)
        g.flush()
        assert names()[1] == {"psm_grows", "psm_b"}
        with mmap.mmap(f.fileno(), 4 * MiB) as view:
            view[:2 * MiB] = b"y" * (2 * MiB)  # two MiB of pages, and no inotify event
            inv, _ = names()
        [grown] = [s for m in inv.mounts for s in m.rows() if s.name == "psm_grows"]
        assert grown.allocated_bytes == 2 * MiB
        os.rename(os.path.join(b, "psm_b"), os.path.join(b, "nccl-b"))
        runs.changed(b, "psm_b")
        runs.changed(b, "nccl-b")  # what the watcher records for the rename
        assert names()[1] == {"psm_grows", "nccl-b"}
        os.rename(os.path.join(b, "nccl-b"), os.path.join(b, "ucx_b"))  # its event still on its way
        assert names()[1] == {"psm_grows", "ucx_b"}
        with mounted_tmpfs("16m", path=b):  # another tmpfs over the same path
            with open(os.path.join(b, "psm_over"), "wb") as h:
                h.write(b"z" * MiB)
            assert names()[1] == {"psm_grows", "psm_over"}
        assert names()[1] == {"psm_grows", "ucx_b"}  # and the first one again once it is gone
        with Peer(a, "mapped", "psm_outside", str(MiB)) as outside:  # in no pod's cgroup
            names()
            killed(outside)
            inv, _ = names()  # the holder outside any pod exited: a full scan
        [gone] = [s for m in inv.mounts for s in m.rows() if s.name == "psm_outside"]
        assert gone.state == "orphan"


def keys_by_pid(owners):
    out = {}
    for key, hs in owners.holdings.items():
        for h in hs:
            out.setdefault(h.pid, set()).add(key)
    return out


@needs_root
def test_a_scoped_scan_leaves_the_last_owners_as_they_were_and_its_index_true(two_pods):
    """A pod-scoped scan shares the last scan's holding lists (copied in C, not rebuilt
    per holding): it must make those it changes anew, never edit them, and its index of
    keys by pid must say what its holdings say."""
    import copy
    (a, b), (cg_a, cg_b) = two_pods
    clock = Clock()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  full_scan_interval=120.0, monotonic=clock, ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [a, b])
    with Peer(a, "mapped", "nccl-a", str(MiB)) as pa, Peer(a, "mapped", "nccl-a1", str(MiB)) as pa1, \
            Peer(b, "mapped", "nccl-b", str(MiB)) as pb:
        for cg, peer in ((cg_a, pa), (cg_a, pa1), (cg_b, pb)):
            into_pod(cg, peer.pid)
        runs.full()
        full = collector._owners
        before = copy.deepcopy(full.holdings)
        assert {k: set(v) for k, v in full.keys_of.items()} == keys_by_pid(full)
        with Peer(a, "mapped", "nccl-a2", str(MiB)) as pa2:
            into_pod(cg_a, pa2.pid)
            killed(pa1)  # pod A's rescan drops its holding: the shared list must not lose it
            clock.now += 15
            inv = runs.full()  # a refresh: pod A read again (a holder exited)
            scoped = collector._owners
            assert scoped is not full and full.holdings == before  # the last scan's, untouched
            assert {k: set(v) for k, v in scoped.keys_of.items()} == keys_by_pid(scoped)
            assert segment(inv, a, "nccl-a2") == ("linked", (pa2.pid,))
            assert pa1.pid not in keys_by_pid(scoped) and pb.pid in keys_by_pid(scoped)


@needs_root
def test_a_quick_run_shows_a_segment_on_a_tmpfs_mounted_anew(two_pods):
    """A tmpfs mounted anew over a pod's volume since the last run: the quick run stats the
    mount again and lists the new instance, not the old one's listing patched."""
    (a, _), _ = two_pods
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [a])
    runs.full()
    with mounted_tmpfs("16m", path=a):
        open(os.path.join(a, "psm_anew"), "wb").close()
        runs.changed(a, "psm_anew")
        assert segment(runs.quick(), a, "psm_anew") is not None


@needs_root
def test_a_memfd_holder_outside_any_pod_that_exits_does_not_bring_a_full_scan_forward(two_pods):
    """runc's cloned binary is a memfd held outside any pod by short-lived processes: its
    holders exiting must not make every refresh a full scan (the memfd waits for the next)."""
    from tests.conftest import ENGINES

    (a, _), _ = two_pods
    clock = Clock()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  full_scan_interval=600.0, monotonic=clock, ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [a])
    with Peer(a, "memfd", str(MiB), script=ENGINES) as holder:
        inv = runs.full()
        assert {holder.pid, int(holder.info)} <= {pid for seg in inv.memfd for pid in seg.holders}
        scanned_at = collector.pace.scanned_at
    clock.now += 15
    runs.full()  # both holders gone, outside any pod: a refresh, not a full scan
    assert collector.pace.scanned_at == scanned_at
    clock.now += 600
    inv = runs.full()  # the next full scan drops them
    assert collector.pace.scanned_at == clock.now
    assert holder.pid not in {pid for seg in inv.memfd for pid in seg.holders}


@needs_root
def test_what_changes_while_the_full_scan_reads_proc_is_never_settled_by_that_scan(two_pods):
    """A full run in three steps (the listing, the owner scan, the assembly) with a quick run
    in the middle, as the scheduler runs it: the scan read the writer before it attached to
    the orphan, and the new segment's creator before it created it. Neither is called leaked
    by that scan; the refresh that follows reads the writer's pod."""
    (a, _), (cg_a, _) = two_pods
    with orphan_attached_later(a, WRITE_IN_PLACE, allocated=True, cgroup=cg_a) as orphan:
        orphan.collector.pace.monotonic.now += 600  # a full scan is due
        staged = orphan.runs.begin()  # listed,
        staged.scan()  # then every process read
        orphan.attach()  # after its process was read
        open(os.path.join(a, "psm_new"), "wb").close()
        orphan.runs.changed(a, "psm_known")  # what the watcher records for both
        orphan.runs.changed(a, "psm_new")
        assert segment(orphan.runs.quick(), a, "psm_new") == ("linked", ())
        inv = orphan.runs.finish(staged)
        assert segment(inv, a, "psm_known") == ("unverified", ())
        assert segment(inv, a, "psm_new") == ("linked", ())
        assert orphan.refresh() == ("linked", (orphan.pid,))


@needs_root
def test_a_quick_run_shows_a_new_segment_while_a_full_scan_is_reading_proc(two_pods):
    """The scheduler runs the owner scan beside quick runs: a create is listed while the scan
    is held up (here on purpose; on a node, 2,000 processes take seconds)."""
    (a, _), _ = two_pods
    seen, cond = [], threading.Condition()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  ignore_unreadable=HOST_EXCUSED_RE)
    scanning, go, scan = threading.Event(), threading.Event(), collector.owner_scan.scan
    go.set()

    def held_up_scan(*args, **kwargs):
        scanning.set()
        go.wait(60)
        return scan(*args, **kwargs)

    def names(obs):
        with cond:
            seen.append({s.name for m in obs.result.mounts for s in m.rows()} if obs.success else set())
            cond.notify_all()

    collector.owner_scan.scan = held_up_scan
    sampler = Sampler([collector], inventory_interval=3600.0, mounts=[a])
    sampler.subscribe(names)
    sampler.start()
    try:
        with cond:
            assert cond.wait_for(lambda: seen, 30), "no first inventory"
        go.clear(), scanning.clear()
        sampler.request(full=True)
        assert scanning.wait(30), "the full run did not start"
        open(os.path.join(a, "psm_during_scan"), "wb").close()
        sampler.changed(a, "psm_during_scan")
        with cond:
            assert cond.wait_for(lambda: "psm_during_scan" in seen[-1], 30), "not listed before the scan ended"
        assert not go.is_set() and not sampler.runners["segments"].scanning.done.is_set()
    finally:
        go.set()
        sampler.stop()


@needs_root
def test_a_change_still_pending_when_the_scan_ends_is_not_settled_by_it(two_pods):
    """The staged scan's end runs before the debounced quick run drains the log: a write that
    came while /proc was read (an attach by a process already read) is not called leaked."""
    (a, _), (cg_a, _) = two_pods
    with orphan_attached_later(a, WRITE_IN_PLACE, allocated=True, cgroup=cg_a) as orphan:
        orphan.collector.pace.monotonic.now += 600  # a full scan is due
        staged = orphan.runs.begin()
        staged.scan()
        orphan.attach()
        orphan.runs.changed(a, "psm_known")  # its write, in the log, not yet drained
        assert segment(orphan.runs.finish(staged), a, "psm_known") == ("unverified", ())


def test_a_mount_gone_or_new_during_the_staged_scan_is_as_the_quick_runs_left_it():
    with mounted_tmpfs() as a, mounted_tmpfs() as b, mounted_tmpfs() as c:
        open(os.path.join(b, "psm_b"), "wb").close()
        mounts = [a, b]
        collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True, ignore_unreadable=HOST_EXCUSED_RE)
        runs = Runs(collector, lambda: list(mounts))
        runs.full()
        staged = runs.begin()
        mounts[:] = [a, c]  # b's pod deleted, c's created while /proc is read
        assert [m.mount for m in runs.quick().mounts] == [a, c]
        staged.scan()
        assert [m.mount for m in runs.finish(staged).mounts] == [a, c]  # b not back (its psm_b not settled)


def test_a_mount_listed_by_a_quick_run_during_the_scan_keeps_that_listing(tmp_path):
    """Not yet a mount point when the staged run began, mounted and listed by a quick run
    before its end: the end does not publish the begin's error over it."""
    late = str(tmp_path / "late")
    os.mkdir(late)
    with mounted_tmpfs() as a:
        collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                      ignore_unreadable=HOST_EXCUSED_RE)
        runs = Runs(collector, [a, late])
        runs.full()
        staged = runs.begin()  # `late` is no mount point yet
        with mounted_tmpfs(path=late):
            open(os.path.join(late, "psm_x"), "wb").close()
            runs.changed(late, "psm_x")
            assert {m.mount: m.error for m in runs.quick().mounts}[late] is None
            staged.scan()
            assert {m.mount: m.error for m in runs.finish(staged).mounts}[late] is None


def test_after_a_failed_scan_a_quick_run_does_not_hand_back_an_inventory_its_walk_moved():
    """The last inventory shares its rows with the listing the failed run walked again: files
    deleted unseen shift the names under the states, and a held file would read as leaked."""
    with mounted_tmpfs() as a:
        for name in ("psm_g1", "psm_g2", "psm_live", "psm_g3"):
            with open(os.path.join(a, name), "wb") as f:
                f.write(b"x" * 8192)
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'rb'); "
                                   "print('ok', flush=True); time.sleep(60)", os.path.join(a, "psm_live")],
                                  stdout=subprocess.PIPE)
        try:
            holder.stdout.readline()
            collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True, ignore_unreadable=HOST_EXCUSED_RE)
            runs = Runs(collector, lambda: [a])
            runs.full()
            for name in ("psm_g1", "psm_g2", "psm_g3"):
                os.unlink(os.path.join(a, name))  # unseen: no watcher
            collector.owner_scan.scan = lambda *args, **kwargs: (_ for _ in ()).throw(OSError("scan failed"))
            collector.owner_scan.refresh = lambda *args, **kwargs: None
            with pytest.raises(OSError):
                runs.staged()
            states = {s.name: s.state for s in runs.quick().mounts[0].rows()}
            assert states == {"psm_live": "linked"}, states
        finally:
            holder.kill()
            holder.wait()


@needs_root
def test_the_full_scan_stretches_while_nothing_changes_and_is_back_to_its_base_on_a_change(two_pods):
    """Idle, every process is read ever more seldom (up to 8x the base); a new segment, a segment
    called leaked, or a holder gone brings the scan back to its base at once."""
    (a, b), (cg_a, _) = two_pods
    clock = Clock()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  full_scan_interval=120.0, monotonic=clock,
                                  ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [a, b], all_watched=True)

    scans, scan = [], collector.owner_scan.scan
    collector.owner_scan.scan = lambda *args, **kw: scans.append(clock.now) or scan(*args, **kw)

    def full_run(after):
        """A full run `after` seconds on: (whether it read every process, its inventory)."""
        clock.now += after
        before = len(scans)
        inv = runs.full()
        return len(scans) > before, inv

    with Peer(a, "mapped", "nccl-a", str(MiB)) as pa:
        into_pod(cg_a, pa.pid)
        assert full_run(0)[0]
        assert full_run(120)[0]  # nothing to compare the first with
        # Idle since: 240 s, 480, then 960 (8 x 120) at most.
        for gap in (240, 480, 960, 960):
            assert not full_run(gap - 1)[0]  # a refresh
            assert full_run(1)[0]
        # A new segment, which only a full scan may call leaked: the base again.
        with open(os.path.join(b, "psm_new"), "wb") as f:
            f.write(b"x" * 4096)
        runs.changed(b, "psm_new")
        assert segment(runs.quick(), b, "psm_new") == ("linked", ())
        assert not full_run(119)[0]
        scanned, inv = full_run(1)
        assert scanned and segment(inv, b, "psm_new") == ("orphan", ())
        # Nothing changed since, but a segment is called leaked: never stretched (a process
        # attaching without writing is seen by a full scan only).
        assert full_run(120)[0]
        os.unlink(os.path.join(b, "psm_new"))
        runs.changed(b, "psm_new")
        runs.quick()
        assert full_run(120)[0]
        assert full_run(120)[0]  # (the deletion was since the scan before)
        assert not full_run(120)[0]  # stretched again: 240 s
        assert full_run(120)[0]  # (480 s next)
        # Its holder gone: its pod is read by a refresh, and every process at the base.
        killed(pa)
        scanned, inv = full_run(60)
        assert not scanned and segment(inv, a, "nccl-a") == ("unverified", ())
        scanned, inv = full_run(60)
        assert scanned and segment(inv, a, "nccl-a") == ("orphan", ())


@needs_root
def test_a_change_inotify_missed_that_the_full_runs_listing_finds_brings_the_scan_back_to_its_base(two_pods):
    """A rename moves no statvfs figure: the listing's events tell it."""
    (a, _), _ = two_pods
    clock = Clock()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True, full_scan_interval=120.0,
                                  monotonic=clock, ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [a], all_watched=True)
    scans, scan = [], collector.owner_scan.scan
    collector.owner_scan.scan = lambda *args, **kw: scans.append(clock.now) or scan(*args, **kw)
    with Peer(a, "mapped", "nccl-a", str(MiB)):
        runs.full()
        clock.now += 120
        runs.full()  # nothing changed since the first: 240 s next
        os.rename(os.path.join(a, "nccl-a"), os.path.join(a, "nccl-b"))  # no event said
        clock.now += 60
        runs.full()  # a refresh, whose listing finds it
        clock.now += 60
        runs.full()
        assert scans == [1000.0, 1120.0, 1240.0]
