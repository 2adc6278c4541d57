"""A render adds each mount's and cgroup's series as the last render made them while the
inputs they are made from are equal (render.Families.parts_of). What it serves must be, byte
for byte, what a render from nothing makes of the same model: through new, held, leaked and
removed segments, an orphan ageing, a mount that stays as it was, and a cgroup whose limit
moved."""
import os
import time

from exporter.collectors.segments import SegmentsCollector
from exporter.collectors.shm_mount import ShmMountCollector
from prometheus_client.exposition import generate_latest

from exporter.exposition.render import encode
from exporter.exposition.metrics import ModelCollector
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from tests.conftest import HOST_EXCUSED_RE, Peer, fallocate, mounted_tmpfs, needs_root, prerequisite_missing
from tests.helpers import registry_for

MiB = 1 << 20


def rendered(collector: ModelCollector) -> bytes:
    return encode(list(collector.collect()), generate_latest)


@needs_root
def test_a_render_from_its_cache_is_a_render_from_nothing():
    with mounted_tmpfs("16m") as a, mounted_tmpfs("16m") as b:
        segments = SegmentsCollector(Paths(), ProcessTable(Paths()), ignore_unreadable=HOST_EXCUSED_RE)
        _, harness = registry_for(ShmMountCollector(Paths()), segments, mounts=[a, b])
        cached = ModelCollector(harness.step)
        runners = harness.sampler.runners

        def same(quick: bool = False) -> bytes:
            runners["shm_mount"].run_once(full=True)
            runners["segments"].run_once(full=not quick)
            mine = rendered(cached)
            assert mine == rendered(ModelCollector(harness.step))
            return mine

        first = same()
        untouched = cached.parts.rows[("segments", b)].part
        state = cached.parts.rows[("state", b)]  # its orphan age, unattributed bytes, ...
        # A full run makes every mount's inventory anew: one equal to the last is not rendered again.
        same()
        assert cached.parts.rows[("segments", b)].part is untouched
        with Peer(a, "mapped", "nccl-held", str(2 * MiB)), Peer(b, "hidden", "nccl-hidden", str(MiB)):
            fallocate(os.path.join(a, "psm_leaked"), MiB)
            hour_ago = time.time() - 3600  # a leak old enough to be named
            os.utime(os.path.join(a, "psm_leaked"), (hour_ago, hour_ago))
            harness.sampler.changed(a, "nccl-held")
            harness.sampler.changed(a, "psm_leaked")
            quick = same(quick=True)  # mount b not touched by the quick run
            assert quick != first and b'name="psm_leaked"' in quick
            assert cached.parts.rows[("segments", b)].part is untouched  # reused, not made again
            # (owners verified depends on every process on the host being readable)
            now = cached.parts.rows[("state", b)]
            assert now.part is state.part or now.inputs != state.inputs
            full = same()
            assert b'state="hidden"' in full and b'state="orphan"' in full
            # Event counters and inotify flags, per mount: one mount's moved, the other's replayed.
            harness.state.set_inotify(a, True)
            harness.state.set_inotify(b, True)
            harness.state.count_event(a, "nccl", "created")
            counted = same()
            assert b'shmwatch_segment_events_total{class="nccl",event="created"' in counted
            harness.state.count_event(b, "python_shm", "created")
            harness.state.count_overflow(a)
            harness.state.set_inotify(b, False)
            assert same() != counted
            time.sleep(1.1)
            fallocate(os.path.join(b, "psm_b"), MiB)
            harness.sampler.changed(b, "psm_b")
            # A quick run in mount b only: mount a's inventory is the same object, but its
            # orphan's age moved on, and its samples are rendered again.
            aged = same(quick=True)
            assert aged != full
        same()
        os.unlink(os.path.join(a, "psm_leaked"))
        harness.sampler.changed(a, "psm_leaked")
        assert b"psm_leaked" not in same(quick=True)


@needs_root
def test_an_inventory_in_another_order_keeps_its_summary_and_its_samples():
    """A quick run patches a name to the end of the listing; the next full run walks the
    directory in the kernel's order. The inventories differ in order only: the summary is
    kept (an equal one made again is dropped), and the mount's samples are reused."""
    with mounted_tmpfs("16m") as a:
        segments = SegmentsCollector(Paths(), ProcessTable(Paths()), ignore_unreadable=HOST_EXCUSED_RE)
        _, harness = registry_for(ShmMountCollector(Paths()), segments, mounts=[a])
        cached = ModelCollector(harness.step)
        runners, step = harness.sampler.runners, harness.step

        def run(full):
            runners["segments"].run_once(full=full)
            rendered(cached)
            return [s.name for s in step._latest["segments"].result.mounts[0].rows()]

        for name in ("psm_1", "psm_2", "psm_3"):
            fallocate(os.path.join(a, name), MiB)
        # Held (by us), so a change to one does not make its state wait for a read of /proc.
        held = [os.open(os.path.join(a, name), os.O_RDONLY) for name in ("psm_1", "psm_2", "psm_3")]
        try:
            walked = run(full=True)
            harness.sampler.changed(a, walked[0])  # reported (its attributes changed, say): patched to the end
            patched = run(full=False)
            summary = step._summaries[a]
            lines = cached.parts.rows[("segments", a)].part
            # The listing is updated in place (a patched name keeps its place), and a walk may
            # still meet the names in another order: either way the summary and samples are kept.
            assert sorted(run(full=True)) == sorted(walked) == sorted(patched)
            assert step._summaries[a] is summary  # equal: kept, compared by identity when rendered
            assert cached.parts.rows[("segments", a)].part is lines
        finally:
            for fd in held:
                os.close(fd)


@needs_root
def test_a_cgroup_whose_figures_moved_is_rendered_again():
    """Cgroup series are reused by value: a limit changed between two renders shows."""
    import uuid

    from exporter.collectors.cgroup import CgroupCollector
    from tests.conftest import remove_cgroup
    root = "/sys/fs/cgroup/memory"
    if not os.path.exists(os.path.join(root, "cgroup.procs")):
        prerequisite_missing(f"needs the cgroup v1 memory controller at {root}")
    name = f"shmwatch-render-{uuid.uuid4().hex[:8]}"
    path = os.path.join(root, name)
    os.makedirs(path)
    try:
        def limit(size):
            with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
                f.write(str(size))
        limit(64 * MiB)
        _, harness = registry_for(CgroupCollector(Paths(), "/" + name, None, None), mounts=[])
        cached = ModelCollector(harness.step)
        first = rendered(cached)
        assert b"shmwatch_cgroup_memory_limit_bytes{" in first and b" 6.7108864e+07\n" in first
        harness.sampler.runners["cgroup"].run_once(full=True)
        assert rendered(cached) == rendered(ModelCollector(harness.step))
        limit(32 * MiB)
        harness.sampler.runners["cgroup"].run_once(full=True)
        moved = rendered(cached)
        assert moved == rendered(ModelCollector(harness.step))
        assert b" 3.3554432e+07\n" in moved and b" 6.7108864e+07\n" not in moved
    finally:
        remove_cgroup(path)


RENAMES_ITSELF = """
import ctypes, mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 1 << 20)
view = mmap.mmap(fd, 1 << 20)
view[:4096] = b"w" * 4096
print("held", flush=True)
sys.stdin.readline()
ctypes.CDLL(None).prctl(15, b"renamed-holder", 0, 0, 0)  # PR_SET_NAME: its comm
print("renamed", flush=True)
sys.stdin.readline()
"""


@needs_root
def test_a_holder_that_renames_itself_is_rendered_under_its_new_name():
    """The mount's inventory stays equal (the same segment, the same holder), so the model
    keeps its summary, and the render its lines: unless a process they name changed its
    comm, which the series carry (top_segment_bytes' owner, process_shm_bytes' comm)."""
    import subprocess
    import sys
    with mounted_tmpfs("16m") as a:
        segments = SegmentsCollector(Paths(), ProcessTable(Paths()), ignore_unreadable=HOST_EXCUSED_RE)
        _, harness = registry_for(ShmMountCollector(Paths()), segments, mounts=[a])
        cached = ModelCollector(harness.step)
        child = subprocess.Popen([sys.executable, "-c", RENAMES_ITSELF, os.path.join(a, "psm_named")],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "held"
            hour_ago = time.time() - 3600  # old enough to be named
            os.utime(os.path.join(a, "psm_named"), (hour_ago, hour_ago))
            harness.sampler.runners["segments"].run_once(full=True)
            assert b'comm="python' in rendered(cached)
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "renamed"
            harness.sampler.runners["segments"].run_once(full=True)
            mine = rendered(cached)
            assert mine == rendered(ModelCollector(harness.step))
            assert f'comm="renamed-holder",mount="{a}"}}'.encode() in mine
            assert b'owner="renamed-holder"' in mine
        finally:
            child.kill()
            child.wait()


def test_parts_reused_make_what_a_render_from_nothing_makes():
    """Rows of parts (Families.parts_of), reusing the rows that are as they were; through a
    changed row, one that adds a family the others lack, and a mount gone from the front.
    Only what the current render used is kept for the next."""
    from exporter.exposition.render import Families

    def one(out, mount, value):
        out.add("shmwatch_mount_used_bytes", [mount], value)
        if value % 7 == 0:
            out.add("shmwatch_mount_inodes", [mount], value // 7)

    def render(mounts, last):
        out = Families(last=last)
        out.parts_of(one, ((("usage", m), {}, m, v) for m, v in mounts))
        return encode(list(out), generate_latest), out.made

    def fresh(mounts):
        out = Families()
        for mount, value in mounts:
            one(out, mount, value)
        return encode(list(out), generate_latest)

    def rows(last):  # the parts by row; last.sites[one] is the whole call's
        return {key: known.part for key, known in last.rows.items()}

    mounts = [(f"/m/{i:03d}", i + 1) for i in range(20)]
    body, last = render(mounts, None)
    assert body == fresh(mounts)
    made, whole = rows(last), last.sites[one].lines
    assert len(made) == 20
    body, last = render(mounts, last)
    assert body == fresh(mounts)
    assert last.sites[one].lines is whole  # every row as it was: the call's lines reused whole
    assert all(last.rows[key].part is parts for key, parts in made.items())  # reused, not made again
    mounts[3] = (mounts[3][0], 7000)  # and a family only it adds
    changed, last = render(mounts, last)
    assert changed == fresh(mounts) and b'shmwatch_mount_inodes{mount="/m/003"} 1000.0' in changed
    again = [key for key, parts in rows(last).items() if parts is not made[key]]
    assert again == [("usage", "/m/003")] and last.sites[one].lines is not whole
    del mounts[0]
    body, last = render(mounts, last)
    assert body == fresh(mounts)
    assert ("usage", "/m/000") not in last.rows and len(rows(last)) == 19


def test_a_part_carries_its_rows_node_labels_and_a_moved_value_is_written_again():
    """Families.parts_of: each part's samples carry the node labels of its row, escaped as
    prometheus_client escapes them; a part whose value moved is made again, the others kept."""
    from exporter.exposition.render import Families

    def render(values, last):
        out = Families(node_mode=True, last=last)
        rows = ((mount, {"pod_uid": f"p{i}"}, "shmwatch_mount_used_bytes", [mount], value)
                for i, (mount, value) in enumerate(values))
        out.parts_of(Families.add, rows)
        return out.parts["shmwatch_mount_used_bytes"], out.made

    values = [(f'/m/"{i}"', i) for i in range(5)]
    first, last = render(values, None)
    values[2] = ('/m/"2"', 7)
    second, _ = render(values, last)
    assert [a is b for a, b in zip(first, second)] == [True, True, False, True, True]
    # (node mode's labels with no value, container_id and volume, are left out)
    assert second[2] == 'shmwatch_mount_used_bytes{mount="/m/\\"2\\"",pod_uid="p2"} 7.0\n'
    assert second == render(values, None)[0]  # as a render from nothing writes them


def test_rows_made_from_the_same_objects_are_not_made_again():
    """Families.parts_of with `same`: while each object the rows are made from is the very
    object it was, the rows are not even iterated; another object, even an equal one, makes
    them again (and equal rows still reuse their parts)."""
    from exporter.exposition.render import Families

    iterated = []

    def rows(counts):
        for mount, value in counts.items():
            iterated.append(mount)
            yield ("usage", mount), {}, "shmwatch_mount_used_bytes", [mount], value

    def render(counts, last):
        out = Families(last=last)
        out.parts_of(Families.add, rows(counts), (counts,))
        return encode(list(out), generate_latest), out.made

    counts = {"/m/a": 1, "/m/b": 2}
    body, last = render(counts, None)
    assert iterated == ["/m/a", "/m/b"]
    again, last = render(counts, last)
    assert again == body and iterated == ["/m/a", "/m/b"]  # not iterated: the same dict
    equal, last = render(dict(counts), last)  # another object: iterated, its parts reused
    assert equal == body and iterated[2:] == ["/m/a", "/m/b"]
    moved, last = render({**counts, "/m/b": 3}, last)
    assert iterated[4:] == ["/m/a", "/m/b"] and b'mount="/m/b"} 3.0' in moved
