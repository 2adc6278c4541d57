"""model/step.py: observations in, one Model out. Each test hands `ModelStep.accept` the
observations a scheduler would publish and reads `current()`: the mounts discovery last
published, each source's status, the peaks recorded once per measure, the summaries kept by
identity for a mount a quick run did not touch, the model built again only when something
moved, and the OOM ledger (the kernel log's kills against the counters, never down)."""

import logging
from typing import List, Optional, Sequence

import pytest

from exporter.model.state import StateStore
from exporter.model.step import OOM_GONE_CHECK_SECONDS, OOM_GONE_RETENTION_SECONDS, ModelStep
from exporter.model.types import CgroupMemory, Inventory, MountInventory, MountSet, MountUsage
from exporter.model.types import Observation, OomKill, OomReports, Target

POD = "0a1b2c3d-1111-2222-3333-444455556666"
POD_CGROUP = f"/kubepods/burstable/pod{POD}"
POD_MOUNT = f"/var/lib/kubelet/pods/{POD}/volumes/kubernetes.io~empty-dir/dshm"


def step(*statuses: str, node_mode: bool = False, memory_limit: Optional[int] = None) -> ModelStep:
    return ModelStep(list(statuses), StateStore(), node_mode=node_mode, memory_limit=memory_limit)


def ok(source: str, result: object, full: bool = True) -> Observation:
    return Observation(source=source, result=result, error=None, duration=0.01, full=full)


def failed(source: str, error: str = "OSError: boom") -> Observation:
    return Observation(source=source, result=None, error=error, duration=0.02)


def targets(*mounts: str, labels: Optional[dict] = None) -> Observation:
    return ok("discovery", MountSet([Target(m, dict(labels or {})) for m in mounts]))


def usage(mount: str, used: int, size: int = 1 << 20) -> MountUsage:
    return MountUsage(mount=mount, fstype="tmpfs", source="shm", is_mount_point=True,
                      size_bytes=size, used_bytes=used, available_bytes=size - used)


def cgroup(path: str, kills: Optional[int], pod_uid: str = "", children: Sequence = (),
           shmem: Optional[int] = None) -> CgroupMemory:
    return CgroupMemory(cgroup=path, version=1, usage_bytes=10, limit_bytes=100, working_set_bytes=10,
                        shmem_bytes=shmem, oom_kills=kills, limit_source="self", pod_uid=pod_uid,
                        child_oom_kills=tuple(children))


def kill(task_memcg: str, pid: int = 4242) -> OomKill:
    return OomKill(seq=pid, boot_usec=1, pid=pid, comm="python", task_memcg=task_memcg,
                   oom_memcg=task_memcg, constraint="CONSTRAINT_MEMCG", anon_rss_bytes=2 << 20,
                   file_rss_bytes=0, shmem_rss_bytes=1 << 20)


def inventory(*mounts: str) -> Inventory:
    return Inventory(mounts=[MountInventory(mount=m) for m in mounts], comms={}, proc_unreadable=0,
                     processes_scanned=1)


def kills(model_step: ModelStep) -> dict:
    return {c.cgroup: c.kills for c in model_step.current().oom_kills}


# --- what the model is made of -----------------------------------------------------------


def test_the_mounts_are_discoverys_last_set_in_its_order_a_failed_run_keeps_it() -> None:
    model_step = step("shm_mount")
    model_step.accept(targets("/b", "/a", labels={"volume": "dshm"}))
    model_step.accept(failed("discovery"))
    views = model_step.current().mounts
    assert [(v.mount, v.labels) for v in views] == [("/b", {"volume": "dshm"}), ("/a", {"volume": "dshm"})]
    assert all(v.usage is None and v.peak_bytes is None for v in views)  # shm_mount has not run


def test_statuses_in_the_order_given_unanswered_failed_and_ok() -> None:
    model_step = step("shm_mount", "segments", "cgroup")
    model_step.accept(ok("segments", inventory()))
    model_step.accept(failed("cgroup", "PermissionError: memory.stat"))
    model_step.accept(ok("discovery", MountSet([])))  # no status series: not listed
    statuses = model_step.current().statuses
    assert [(s.name, s.success, s.error) for s in statuses] == [
        ("shm_mount", False, None), ("segments", True, None), ("cgroup", False, "PermissionError: memory.stat")]
    assert statuses[2].duration == 0.02


def test_a_failed_run_drops_the_sources_last_result() -> None:
    """A result that failed is not shown as the last good one: absent, never stale."""
    model_step = step("shm_mount")
    model_step.accept(targets("/m"))
    model_step.accept(ok("shm_mount", [usage("/m", 300)]))
    assert model_step.current().mounts[0].usage == usage("/m", 300)
    model_step.accept(failed("shm_mount"))
    assert model_step.current().mounts[0].usage is None


def test_a_mount_view_joins_usage_peak_and_high_water_mark() -> None:
    model_step = step("shm_mount")
    model_step.accept(targets("/m"))
    model_step.accept(ok("shm_mount", [usage("/m", 700)]))
    model_step.accept(ok("shm_mount", [usage("/m", 200)]))
    view = model_step.current().mounts[0]
    assert (view.usage and view.usage.used_bytes, view.peak_bytes, view.max_used_bytes) == (200, 700, 700)
    assert view.max_used_at is not None and view.budget is not None


def test_a_quick_runs_unmeasured_mounts_are_not_recorded_again() -> None:
    """A quick run hands back the last poll's usage objects for the mounts it did not
    measure: only the measured ones reach the state store (its version moves with each)."""
    model_step = step("shm_mount")
    state = model_step.state
    a, b = usage("/a", 100), usage("/b", 200)
    model_step.accept(ok("shm_mount", [a, b]))
    version = state.version()
    model_step.accept(ok("shm_mount", [a, b], full=False))
    assert state.version() == version
    model_step.accept(ok("shm_mount", [a, usage("/b", 250)], full=False))
    assert state.version() == version + 1
    model_step.accept(ok("shm_mount", [a, b], full=True))  # a poll measures all: recorded
    assert state.version() > version + 1


def test_a_mounts_summary_is_kept_while_a_quick_run_hands_back_its_inventory() -> None:
    """A render compares the summary by identity: the same inventory object keeps it; a new
    one equal to the last keeps it too; a failed run has none."""
    model_step = step("segments")
    model_step.accept(targets("/a", "/b"))
    first = inventory("/a", "/b")
    model_step.accept(ok("segments", first))
    before = {v.mount: v.summary for v in model_step.current().mounts}
    assert all(before.values())
    again = Inventory(mounts=[first.mounts[0], MountInventory(mount="/b")], comms={}, proc_unreadable=0,
                      processes_scanned=1)
    model_step.accept(ok("segments", again, full=False))
    after = {v.mount: v.summary for v in model_step.current().mounts}
    assert after["/a"] is before["/a"] and after["/b"] is before["/b"]
    model_step.accept(failed("segments"))
    assert all(v.summary is None and v.inventory is None for v in model_step.current().mounts)


def test_the_model_is_built_again_only_after_something_was_accepted() -> None:
    model_step = step("shm_mount")
    model = model_step.current()
    assert model_step.current() is model
    model_step.accept(ok("shm_mount", []))
    rebuilt = model_step.current()
    assert rebuilt is not model and model_step.current() is rebuilt
    model_step.state.count_overflow("/m")  # the watcher, on its thread
    assert model_step.current() is not rebuilt


def test_the_effective_size_is_incomplete_while_the_limit_is_unknown() -> None:
    """The cgroup source unread and no --memory.limit-bytes: the limit is unknown (the
    budget is not complete), never taken as none."""
    model_step = step("shm_mount", "cgroup")
    model_step.accept(targets("/m"))
    model_step.accept(ok("shm_mount", [usage("/m", 10)]))
    model_step.accept(failed("cgroup"))
    assert not model_step.current().mounts[0].budget_complete
    known = step("shm_mount", "cgroup", memory_limit=1 << 30)
    known.accept(targets("/m"))
    known.accept(ok("shm_mount", [usage("/m", 10)]))
    known.accept(failed("cgroup"))
    assert known.current().mounts[0].budget_complete


def test_node_mode_ignores_the_one_workloads_memory_limit() -> None:
    assert step(node_mode=True, memory_limit=1 << 30).memory_limit is None
    assert step(memory_limit=1 << 30).memory_limit == 1 << 30


def test_shmem_unexplained_is_the_cgroups_shmem_less_its_mounts() -> None:
    model_step = step("shm_mount", "cgroup", "segments")
    model_step.accept(targets("/m"))
    model_step.accept(ok("shm_mount", [usage("/m", 300)]))
    model_step.accept(ok("cgroup", [cgroup("/workload", 0, shmem=1000)]))
    model_step.accept(ok("segments", inventory("/m")))
    assert model_step.current().shmem_unexplained == {"/workload": 700}


# --- the OOM ledger ----------------------------------------------------------------------


def test_a_logged_kill_is_counted_logged_and_kept_with_the_shm_used_then(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="exporter.model.step")
    model_step = step("shm_mount", "cgroup", "oom")
    model_step.accept(targets("/m"))
    model_step.accept(ok("shm_mount", [usage("/m", 3 << 20)]))
    model_step.accept(ok("cgroup", [cgroup("/workload", None)]))
    model_step.accept(ok("oom", OomReports(new=(kill("/workload"),), lost=0)))
    assert kills(model_step) == {"/workload": 1}
    recent = model_step.current().recent_oom_kills
    assert [(r.kill.pid, r.shm_used_bytes) for r in recent] == [(4242, 3 << 20)]
    assert "OOM kill: pid 4242 (python)" in caplog.text and "shm used 3.0MiB" in caplog.text


def test_the_counter_wins_when_higher_and_no_count_ever_goes_down() -> None:
    """Kills before shmwatch started are in the cgroup's counter only; a counter read lower
    later (a cgroup recreated at the path) does not take the series down."""
    model_step = step("cgroup", "oom")
    model_step.accept(ok("cgroup", [cgroup("/workload", 5)]))
    model_step.accept(ok("oom", OomReports(new=(kill("/workload"),), lost=0)))
    assert kills(model_step) == {"/workload": 5}
    model_step.accept(ok("cgroup", [cgroup("/workload", 0)]))
    assert kills(model_step) == {"/workload": 5}
    model_step.accept(ok("oom", OomReports(new=tuple(kill("/workload", p) for p in (1, 2, 3, 4, 5, 6)), lost=0)))
    assert kills(model_step) == {"/workload": 7}
    model_step.accept(failed("cgroup"))  # a sidecar's one cgroup, not read this time
    assert kills(model_step) == {"/workload": 7}


def test_no_count_without_a_source_that_counts_kills() -> None:
    """Neither the kernel log read nor a counter: no series, not a confident 0."""
    model_step = step("cgroup")
    model_step.accept(ok("cgroup", [cgroup("/workload", None)]))
    assert kills(model_step) == {}
    counted = step("cgroup")
    counted.accept(ok("cgroup", [cgroup("/workload", 0)]))
    assert kills(counted) == {"/workload": 0}


def test_v1_counts_the_pod_and_each_containers_highest_kept_after_it_is_gone() -> None:
    """v1 counts a kill in the victim's memcg only: the pod's count adds its containers',
    and a container removed keeps what its counter last said."""
    model_step = step("cgroup", node_mode=True)
    model_step.accept(ok("cgroup", [cgroup(POD_CGROUP, 1, POD, children=[(f"{POD_CGROUP}/c1", 2)])]))
    assert kills(model_step) == {POD_CGROUP: 3}
    model_step.accept(ok("cgroup", [cgroup(POD_CGROUP, 1, POD, children=[(f"{POD_CGROUP}/c2", 1)])]))
    assert kills(model_step) == {POD_CGROUP: 4}


def test_node_mode_counts_a_kill_under_its_pod() -> None:
    model_step = step("cgroup", "oom", node_mode=True)
    model_step.accept(targets(POD_MOUNT, labels={"pod_uid": POD}))
    model_step.accept(ok("oom", OomReports(new=(kill(f"{POD_CGROUP}/container1"),), lost=0)))
    model_step.accept(ok("cgroup", [cgroup(POD_CGROUP, None, POD)]))
    counts = model_step.current().oom_kills
    assert [(c.cgroup, c.pod_uid, c.kills) for c in counts] == [(POD_CGROUP, POD, 1)]


def test_a_count_stays_while_its_pod_lives_though_its_cgroup_was_not_read() -> None:
    """Its cgroup read failed once, discovery still sees the pod's mount: PodOomKilled would
    fire on a series that went away and came back. Gone with its pod's mount."""
    model_step = step("cgroup", "oom", node_mode=True)
    model_step.accept(targets(POD_MOUNT, labels={"pod_uid": POD}))
    model_step.accept(ok("oom", OomReports(new=(), lost=0)))
    model_step.accept(ok("cgroup", [cgroup(POD_CGROUP, 2, POD)]))
    assert kills(model_step) == {POD_CGROUP: 2}
    model_step.accept(failed("cgroup"))
    assert kills(model_step) == {POD_CGROUP: 2}
    model_step.accept(ok("discovery", MountSet([])))  # the pod deleted
    assert kills(model_step) == {}


def test_node_mode_shows_a_kill_in_a_pod_never_seen() -> None:
    """The pod was deleted before a cgroup run read it: its kill still has a series."""
    model_step = step("cgroup", "oom", node_mode=True)
    model_step.accept(ok("cgroup", []))
    model_step.accept(ok("oom", OomReports(new=(kill(f"{POD_CGROUP}/c"),), lost=0)))
    counts = model_step.current().oom_kills
    assert [(c.cgroup, c.pod_uid, c.kills) for c in counts] == [(POD_CGROUP, POD, 1)]


def test_the_recent_kills_are_the_newest_fifty_oldest_first() -> None:
    model_step = step("oom")
    new: List[OomKill] = [kill("/w", pid) for pid in range(1, 61)]
    model_step.accept(ok("oom", OomReports(new=tuple(new), lost=0)))
    recent = model_step.current().recent_oom_kills
    assert [r.kill.pid for r in recent] == list(range(11, 61))



class Clock:
    """The model step's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


BYSTANDER = "5e6f7a8b-1111-2222-3333-444455556666"  # a pod that stays: its cgroup run read pods


def pod_cgroups(*uids: str, kills: int = 0) -> Observation:
    """A node-mode cgroup run that read these pods (and the bystander), systemd layout."""
    found = [cgroup(f"/kubepods.slice/kubepods-pod{u.replace('-', '_')}.slice", kills, u) for u in uids]
    return ok("cgroup", [*found, cgroup(f"/kubepods/pod{BYSTANDER}", 0, BYSTANDER)])


def test_a_deleted_pods_kill_is_shown_for_an_hour_then_leaves_the_ledger() -> None:
    """PodOomKilled's increase() over 10 minutes must see the kill of a pod deleted at once;
    a series per pod ever killed, for good, is not a bounded label. A pod seen again starts
    its hour anew; a cgroup run that failed or read no pod takes nobody for deleted."""
    other, clock = POD.replace("0a1b", "9f8e"), Clock()
    pod_cgroup = f"/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice"
    model_step = ModelStep(["cgroup", "oom"], StateStore(), node_mode=True, monotonic=clock)
    model_step.accept(pod_cgroups(POD, other, kills=0))
    model_step.accept(ok("oom", OomReports(new=(kill(f"{pod_cgroup}/cri-containerd-1.scope"),), lost=0)))
    assert kills(model_step)[pod_cgroup] == 1
    model_step.accept(pod_cgroups())  # both deleted
    assert pod_cgroup in kills(model_step)  # never read again, but killed: still shown
    clock.now += OOM_GONE_CHECK_SECONDS  # the next look (a scrape's build) finds them gone
    model_step.accept(pod_cgroups())
    assert pod_cgroup in kills(model_step)
    clock.now += OOM_GONE_RETENTION_SECONDS - 1
    model_step.accept(pod_cgroups(other))  # seen again: its hour starts anew
    assert pod_cgroup in kills(model_step)
    for failed_or_empty in (failed("cgroup"), ok("cgroup", [])):
        clock.now += OOM_GONE_CHECK_SECONDS
        model_step.accept(failed_or_empty)
        assert pod_cgroup in kills(model_step)  # says nothing of who is gone
    clock.now += OOM_GONE_CHECK_SECONDS
    model_step.accept(pod_cgroups())
    assert set(kills(model_step)) == {f"/kubepods/pod{BYSTANDER}"}
    assert not any(POD in c for c in [*model_step._oom_logged, *model_step._oom_own])  # the memory too
    assert any(other.replace("-", "_") in c for c in model_step._oom_own)  # gone minutes, not an hour


def test_a_pod_kept_by_its_mount_stays_and_a_kill_counted_as_another_leaves_is_shown() -> None:
    """A pod discovery still sees by its mount is not deleted, though its cgroup was not
    read. And a kill logged for a live pod in the build that forgets a deleted one's (the
    sums as before) is counted, not hidden behind the last counts."""
    other, clock = POD.replace("0a1b", "9f8e"), Clock()
    model_step = ModelStep(["cgroup", "oom"], StateStore(), node_mode=True, monotonic=clock)
    model_step.accept(targets(POD_MOUNT, labels={"pod_uid": POD}))
    model_step.accept(ok("oom", OomReports(new=(kill(f"{POD_CGROUP}/c"),), lost=0)))  # not read yet
    model_step.accept(ok("oom", OomReports(new=(kill(f"/kubepods/pod{other}/c"),), lost=0)))
    model_step.accept(pod_cgroups())
    kills(model_step)
    clock.now += OOM_GONE_CHECK_SECONDS
    model_step.accept(pod_cgroups())
    assert kills(model_step) == {POD_CGROUP: 1, f"/kubepods/pod{other}": 1, f"/kubepods/pod{BYSTANDER}": 0}
    clock.now += OOM_GONE_RETENTION_SECONDS
    model_step.accept(ok("oom", OomReports(new=(kill(f"/kubepods/pod{BYSTANDER}/c"),), lost=0)))
    assert kills(model_step) == {POD_CGROUP: 1, f"/kubepods/pod{BYSTANDER}": 1}


def test_a_sidecar_forgets_no_kill_and_node_mode_counts_pods_kills_only() -> None:
    """A sidecar's cgroups are its own: nothing is deleted under it. Node mode shows pods
    only: a systemd scope's kill would sit in the ledger for good, never shown."""
    clock = Clock()
    sidecar = ModelStep(["cgroup", "oom"], StateStore(), monotonic=clock)
    sidecar.accept(ok("cgroup", [cgroup(POD_CGROUP, 0, POD)]))
    sidecar.accept(ok("oom", OomReports(new=(kill(f"{POD_CGROUP}/c"),), lost=0)))
    assert kills(sidecar) == {POD_CGROUP: 1}
    for _ in range(2):  # its one cgroup read under another path (moved), for hours
        clock.now += OOM_GONE_RETENTION_SECONDS
        sidecar.accept(ok("cgroup", [cgroup("/moved", 0)]))
        assert kills(sidecar) == {POD_CGROUP: 1, "/moved": 0} and f"{POD_CGROUP}/c" in sidecar._oom_logged
    node = ModelStep(["cgroup", "oom"], StateStore(), node_mode=True, monotonic=clock)
    node.accept(ok("oom", OomReports(new=(kill("/system.slice/run-r1.scope"),), lost=0)))
    node.accept(pod_cgroups())
    assert kills(node) == {f"/kubepods/pod{BYSTANDER}": 0} and not node._oom_logged
    assert [r.kill.task_memcg for r in node.current().recent_oom_kills] == ["/system.slice/run-r1.scope"]
