"""model/summary.py: which segments a series may name, and which the exporter names.

A segment's name is a label only while it is bounded and worth acting on: a leak (an orphan
of a class that leaks) last modified ORPHAN_NAMED_AFTER_SECONDS ago, any other segment
NAMED_AFTER_SECONDS ago, --segments.top-k of them on the exporter (not per mount), leaks first.
"""

import pytest

from exporter.host.kube import pod_uid_of_mount
from exporter.model.classes import CLASS_NAMES
from exporter.model.summary import (
    NAMED_AFTER_SECONDS,
    ORPHAN_NAMED_AFTER_SECONDS,
    cgroups_by_pod,
    named_first,
    named_now,
    named_on_exporter,
    owner_comm,
    shm_budget,
    summarise,
)
from exporter.model.types import CgroupMemory, ClassTotals, MountInventory, MountUsage, Segment
from tests.helpers import GiB, inventory, pack

MiB = 1 << 20
NOW = 1_000_000.0


def seg(name, cls="python_shm", state="linked", size=MiB, age=3600.0, holders=()):
    """A segment last modified `age` seconds before NOW (None: time not known)."""
    mtime = 0.0 if age is None else NOW - age
    return Segment(name, cls, state, size, size, mtime, holders)


def test_a_segment_is_named_once_old_enough_a_leak_sooner():
    assert named_now(seg("a", age=NAMED_AFTER_SECONDS), NOW)
    assert not named_now(seg("a", age=NAMED_AFTER_SECONDS - 1), NOW)
    assert named_now(seg("o", state="orphan", age=ORPHAN_NAMED_AFTER_SECONDS), NOW)
    assert not named_now(seg("o", state="orphan", age=ORPHAN_NAMED_AFTER_SECONDS - 1), NOW)
    for state in ("hidden", "unverified"):  # only an orphan is named sooner
        assert not named_now(seg("x", state=state, age=ORPHAN_NAMED_AFTER_SECONDS), NOW), state
    # A time not known (an unlinked segment only mapped) is not "old": never named.
    assert not named_now(seg("h", state="hidden", age=None), NOW)
    assert not named_now(seg("o", state="orphan", age=None), NOW)
    assert ORPHAN_NAMED_AFTER_SECONDS < NAMED_AFTER_SECONDS


def test_leaks_come_first_then_the_largest():
    leak = seg("psm_small", state="orphan", size=1)
    semaphore = seg("sem.x", cls="semaphore", state="orphan", size=2 * MiB)  # not a leak
    big = seg("nccl-big", cls="nccl", size=3 * MiB)
    same_size = seg("a", size=3 * MiB)
    assert sorted([big, semaphore, same_size, leak], key=named_first) == [leak, same_size, big, semaphore]


def test_the_summary_keeps_the_segments_to_name():
    """Young segments are counted, never named; with no `now` every segment may be."""
    inv = inventory("/m", [
        seg("psm_young_leak", state="orphan", age=ORPHAN_NAMED_AFTER_SECONDS - 5, size=9 * MiB),
        seg("psm_old_leak", state="orphan", age=ORPHAN_NAMED_AFTER_SECONDS + 5),
        seg("nccl-young", cls="nccl", age=NAMED_AFTER_SECONDS - 5, size=8 * MiB),
        seg("nccl-old", cls="nccl", age=NAMED_AFTER_SECONDS + 5, size=2 * MiB),
        seg("torch_tiny", cls="torch", age=7200, size=4096),
    ])
    s = summarise(inv, 2, now=NOW)
    assert [x.name for x in s.top] == ["psm_old_leak", "nccl-old"]
    assert [x.name for x in summarise(inv, 5, now=NOW).top] == ["psm_old_leak", "nccl-old", "torch_tiny"]
    assert s.totals[("python_shm", "orphan")].count == 2 and s.totals[("nccl", "linked")].count == 2  # all counted
    assert [x.name for x in s.leaked] == ["psm_young_leak", "psm_old_leak"]  # check names every leak
    assert [x.name for x in summarise(inv, 2).top] == ["psm_young_leak", "psm_old_leak"]


def test_the_exporter_names_top_k_across_its_mounts():
    """Not K a mount: 200 pods' long-lived segments give K series, and a leak on any mount
    comes before a larger segment on another."""
    mounts = [(f"pod{i}", summarise(inventory(f"/m{i}", [
        seg(f"psm_{i}_a", size=(i + 1) * MiB), seg(f"psm_{i}_b", size=(i + 1) * MiB + 512)]), 10, now=NOW))
        for i in range(200)]
    leak = summarise(inventory("/leaky", [seg("nccl-left", cls="nccl", state="orphan", size=1)]), 10, now=NOW)
    chosen = named_on_exporter(mounts + [("leaky", leak)], 3)
    assert [(key, s.name) for key, s in chosen] == [("leaky", "nccl-left"), ("pod199", "psm_199_b"),
                                                    ("pod199", "psm_199_a")]
    assert named_on_exporter(mounts, 0) == []
    assert len(named_on_exporter(mounts, 10)) == 10


def test_an_owner_is_a_process_name_not_a_pid():
    assert owner_comm((), {}) == ""
    assert owner_comm((7, 8), {7: "vllm", 8: "python3"}) == "vllm"
    assert owner_comm((9,), {}) == "unknown"


def totals(t):
    return t.count, t.allocated_bytes, t.apparent_bytes


# --- a degraded mount's summary -------------------------------------------------------------
def test_a_degraded_mount_counts_its_classes_as_unverified():
    """Past --inventory.max-segments a mount keeps counts and bytes by class only: they are
    summarised as unverified, next to what is listed, and the summary says it is degraded."""
    degraded = {"torch": ClassTotals(count=3, allocated_bytes=12 * MiB, apparent_bytes=12 * MiB + 7),
                "nccl": ClassTotals(count=2, allocated_bytes=4 * MiB, apparent_bytes=5 * MiB)}
    inv = MountInventory("/dev/shm", degraded=degraded, names=("torch_x",),
                         packed=(pack(CLASS_NAMES.index("torch"), 0, 9, 0, MiB // 512, MiB + 1),),
                         states=bytes([3]))  # unverified
    s = summarise(inv, 5)
    assert s.degraded is True
    assert totals(s.totals[("torch", "unverified")]) == (4, 13 * MiB, 13 * MiB + 8)
    assert totals(s.totals[("nccl", "unverified")]) == (2, 4 * MiB, 5 * MiB)
    assert s.totals.keys() == {("torch", "unverified"), ("nccl", "unverified")}
    assert s.bytes_by_class == {"torch": 13 * MiB, "nccl": 4 * MiB}
    assert [x.name for x in s.unverified] == ["torch_x"]  # no names kept for the rest
    assert summarise(MountInventory("/dev/shm"), 5).degraded is False
    assert summarise(MountInventory("/dev/shm", degraded={}), 5).degraded is True  # past the cap, all gone


def test_past_the_listed_cap_the_largest_leaks_are_named_of_each_kind():
    """Fifty (LISTED) named of the removable orphans, fifty of the others, fifty unverified:
    the largest, largest first; the oldest orphan is the oldest removable one wherever it
    comes in the listing."""
    from exporter.model.summary import LISTED
    from exporter.model.types import STATES
    listed, states, n = {}, bytearray(), LISTED + 10
    for i in range(n):  # the smallest and the oldest first
        for cls, state, prefix in (("torch", "orphan", "t"), ("other", "orphan", "o"), ("nccl", "unverified", "u")):
            listed[f"{prefix}{i:03}"] = pack(CLASS_NAMES.index(cls), 0, len(listed) + 1, 1000 + i, i + 1, 512 * (i + 1))
            states.append(STATES.index(state))
    inv = MountInventory("/dev/shm", names=tuple(listed), packed=tuple(listed.values()), states=bytes(states))
    s = summarise(inv, 3)
    removable = [f"t{i:03}" for i in range(n - 1, n - 1 - LISTED, -1)]
    others = [f"o{i:03}" for i in range(n - 1, n - 1 - LISTED, -1)]
    assert [x.name for x in s.leaked] == [name for pair in zip(others, removable) for name in pair]
    assert [x.name for x in s.unverified] == [f"u{i:03}" for i in range(n - 1, n - 1 - LISTED, -1)]
    assert s.oldest_orphan_mtime == 1000
    orphans = (n, sum(512 * (i + 1) for i in range(n)))
    assert totals(s.totals["torch", "orphan"])[:2] == totals(s.totals["other", "orphan"])[:2] == orphans


def mount(size, used):
    return MountUsage("/dev/shm", "tmpfs", "shm", True, size_bytes=size, used_bytes=used, available_bytes=size - used)


def cgroup(limit, working_set, uid=""):
    return CgroupMemory("/kubepods/pod", 2, working_set, limit, working_set, None, 0, "cgroup", uid)


def test_room_counts_shm_once():
    # 16 GiB tmpfs holding 1 GiB, in a pod at 3 GiB of an 8 GiB limit: the 1 GiB of shm is part
    # of the 3 GiB, so the rest of the pod uses 2 GiB and leaves 6 GiB for shm, not 5.
    b = shm_budget(mount(16 * GiB, GiB), cgroup(8 * GiB, 3 * GiB))
    assert b.room_bytes == 6 * GiB
    assert b.effective_bytes == 6 * GiB
    assert b.fillable_bytes == 16 * GiB
    assert b.projection == pytest.approx((2 + 16) / 8)


def test_effective_is_bounded_by_the_tmpfs_when_the_limit_is_generous():
    b = shm_budget(mount(4 * GiB, GiB), cgroup(64 * GiB, 3 * GiB))
    assert (b.effective_bytes, b.room_bytes) == (4 * GiB, 62 * GiB)
    assert b.projection == pytest.approx((2 + 4) / 64)


def test_size_limit_below_the_tmpfs_binds():
    # Older kubelets leave the tmpfs at half of node RAM and enforce sizeLimit by eviction.
    b = shm_budget(mount(64 * GiB, 0), cgroup(128 * GiB, GiB), size_limit=16 * GiB)
    assert (b.fillable_bytes, b.effective_bytes) == (16 * GiB, 16 * GiB)
    assert b.projection == pytest.approx((1 + 16) / 128)
    # A sizeLimit above the tmpfs does not enlarge it.
    assert shm_budget(mount(4 * GiB, 0), None, size_limit=16 * GiB).effective_bytes == 4 * GiB


def test_working_set_below_shm_used_clamps_at_zero():
    # Pages can be charged elsewhere (another cgroup touched them first): never negative.
    b = shm_budget(mount(8 * GiB, 4 * GiB), cgroup(2 * GiB, GiB))
    assert b.room_bytes == 2 * GiB and b.effective_bytes == 2 * GiB
    assert b.projection == pytest.approx(8 / 2)
    full = shm_budget(mount(8 * GiB, 0), cgroup(GiB, 3 * GiB))
    assert full.room_bytes == 0 and full.effective_bytes == 0


def test_without_a_cgroup_the_flag_limit_alone_bounds_it():
    b = shm_budget(mount(16 * GiB, GiB), None, memory_limit=4 * GiB)
    assert (b.fillable_bytes, b.effective_bytes, b.room_bytes, b.projection) == (16 * GiB, 4 * GiB, 4 * GiB, None)
    b = shm_budget(mount(2 * GiB, GiB), None, memory_limit=4 * GiB)
    assert b.effective_bytes == 2 * GiB
    # An unlimited cgroup: the tmpfs alone, no projection.
    b = shm_budget(mount(2 * GiB, GiB), cgroup(None, GiB), memory_limit=GiB)
    assert (b.fillable_bytes, b.effective_bytes, b.room_bytes, b.projection) == (2 * GiB, 2 * GiB, None, None)
    assert shm_budget(mount(2 * GiB, 0), None).effective_bytes == 2 * GiB


UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def test_node_mode_charges_a_mount_to_its_pod():
    mount_path = f"/var/lib/kubelet/pods/{UID}/volumes/kubernetes.io~empty-dir/dshm"
    assert pod_uid_of_mount(mount_path) == UID
    assert pod_uid_of_mount("/dev/shm") == ""
    mine, other = cgroup(GiB, 0, UID), cgroup(2 * GiB, 0, "ffffffff-4b5a-6978-8796-a5b4c3d2e1f0")
    assert cgroups_by_pod([other, mine]).get(pod_uid_of_mount(mount_path)) is mine
    assert cgroups_by_pod([other, mine]).get(pod_uid_of_mount("/dev/shm")) is None
    sidecar, second = cgroup(GiB, 0), cgroup(2 * GiB, 0)
    assert cgroups_by_pod([sidecar, second]).get(pod_uid_of_mount("/dev/shm")) is sidecar  # the first watched cgroup


def test_the_k_first_are_those_of_a_stable_sort_however_many_are_met():
    """A storm's segments are kept k at a time (cut back as they come): the k first are
    always those a stable sort of every segment would give, ties in the order met."""
    import random
    from exporter.model.summary import _First, _largest
    rng = random.Random(43)
    met = [seg(f"s{rng.randrange(40):02}", size=rng.choice((1, 2, 3)) * MiB) for _ in range(1000)]
    for k in (0, 1, 10, 50, 400):
        first = _First(k, named_first)
        for s in met:
            first.add(s)
        assert first.first() == sorted(met, key=named_first)[:k]
        largest = _First(k)
        for s in met:
            largest.add(s)
        assert [id(s) for s in largest.first()] == [id(s) for s in sorted(met, key=_largest)[:k]]
