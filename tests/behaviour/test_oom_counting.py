"""OOM kills as users count them (shmwatch_cgroup_oom_kills_total, PodOomKilled): from the kernel
log's reports (the fixture kmsg) and from the cgroups' own counters (v1 memory.oom_control,
v2 memory.events), in either order; a kill both sources see is one kill. A restart of
shmwatch reads the kernel log from its end: what happened before comes from the counters
alone, is never counted twice, and the count never goes down while the pod is there.

The cells feed the model step as the scheduler does; the restart runs for real: two exporter
processes in turn on a real v1 pod and container cgroup pair, real kills, the real /dev/kmsg."""

import time
from dataclasses import replace
from typing import Callable, List, Optional, Sequence, Tuple

import pytest

from exporter.model.state import StateStore
from exporter.model.step import ModelStep
from exporter.model.types import CgroupMemory, MountSet, Observation, OomKill, OomReports, Target
from tests.conftest import Exporter, needs_root, remove_cgroup, select, value
from tests.system.test_oom import POD, fixture_kills, kill_a_hog_in, pod_with_a_container, step_with_pod_mount

POD_CGROUP = f"/kubepods/burstable/pod{POD}"
CONTAINER = f"{POD_CGROUP}/4f2a9c0e1b"  # the fixture kill's task_memcg
OTHER_POD = "0a0b0c0d-1111-2222-3333-444455556666"  # the fixture's legacy (pre-4.19) kill


def kill(n: int) -> OomKill:
    """The fixture's cgroupfs-driver kill in POD's container, as the n-th kill there."""
    [first] = [k for k in fixture_kills() if k.task_memcg == CONTAINER]
    return replace(first, seq=first.seq + n, pid=first.pid + n)


Event = Callable[[], Observation]


def logged(*ns: int) -> Event:
    """The kernel log's reports of these kills, read in one run of the oom source."""
    return lambda: Observation("oom", OomReports(tuple(kill(n) for n in ns), 0), None, 0.0)


def v2_counter(kills: int) -> Event:
    """v2: the pod's memory.events oom_kill, hierarchical (its containers' kills in it)."""
    pod = CgroupMemory(POD_CGROUP, 2, 0, None, 0, None, kills, "none", pod_uid=POD)
    return lambda: Observation("cgroup", [pod], None, 0.0)


def v1_counters(*containers: Tuple[str, int]) -> Event:
    """v1: the pod's own oom_kill says 0 (a kill counts in the victim's memcg only); each
    container cgroup still there says its own."""
    children = tuple((f"{POD_CGROUP}/{name}", n) for name, n in containers)
    pod = CgroupMemory(POD_CGROUP, 1, 0, None, 0, None, 0, "none", pod_uid=POD, child_oom_kills=children)
    return lambda: Observation("cgroup", [pod], None, 0.0)


def counts(step: ModelStep, events: Sequence[Event]) -> List[Optional[int]]:
    """The pod's series after each event, as scrapes between them would show it (None: no
    series, before any source could count the pod's kills)."""
    shown = []
    for event in events:
        step.accept(event())
        series = {c.cgroup: c.kills for c in step.current().oom_kills}
        shown.append(series.get(POD_CGROUP))
    return shown


# One pod, node mode: (events in order) -> the series after each. C1: the container of the
# fixture's kill, c2 another.
C1 = CONTAINER.rsplit("/", 1)[1]
ONCE = {
    "v2: the log first, then the counter": ([logged(1), v2_counter(1)], [1, 1]),
    "v2: the counter first, then the log": ([v2_counter(1), logged(1)], [1, 1]),
    "v2: two kills, each seen by both": ([logged(1), v2_counter(1), logged(2), v2_counter(2)], [1, 1, 2, 2]),
    "v2: the counter alone (the report lost)": ([logged(), v2_counter(1), v2_counter(2)], [None, 1, 2]),
    "v2: the log alone (the counter not read yet)": ([logged(1), logged(2)], [1, 2]),
    "v1: the log, then the container's counter": ([logged(1), v1_counters((C1, 1))], [1, 1]),
    "v1: the container's counter, then the log": ([v1_counters((C1, 1)), logged(1)], [1, 1]),
    "v1: the container gone before a poll saw it": ([logged(), v1_counters(), logged(1)], [None, 0, 1]),
    "v1: seen, then the container gone": ([logged(1), v1_counters((C1, 1)), v1_counters()], [1, 1, 1]),
    "v1: two containers' counters add up": ([v1_counters((C1, 1), ("c2", 2)), logged(1)], [3, 3]),
}


@pytest.mark.parametrize("events, expected", ONCE.values(), ids=ONCE.keys())
def test_a_kill_both_sources_see_is_counted_once(events: List[Event], expected: List[Optional[int]]) -> None:
    step, _ = step_with_pod_mount(POD)
    assert counts(step, events) == expected


# A restart: a new process, the kernel log read from its end (the kills before it are never
# in it), the counters already at N. (events) -> the series after each.
RESTART = {
    "v2: the counter at 3": ([logged(), v2_counter(3)], [None, 3]),
    "v2: at 3, then a kill, the log first": ([logged(), v2_counter(3), logged(4), v2_counter(4)], [None, 3, 3, 4]),
    "v2: at 3, then a kill, the counter first": ([v2_counter(3), v2_counter(4), logged(4)], [3, 4, 4]),
    "v1: a live container at 2, then a kill in it": (
        [v1_counters((C1, 2)), logged(3), v1_counters((C1, 3))],
        [2, 2, 3],
    ),
    "v1: then that container gone": ([v1_counters((C1, 2)), v1_counters()], [2, 2]),
}


@pytest.mark.parametrize("events, expected", RESTART.values(), ids=RESTART.keys())
def test_after_a_restart_the_counters_say_what_came_before_and_nothing_twice(
    events: List[Event], expected: List[Optional[int]]
) -> None:
    step, _ = step_with_pod_mount(POD)  # a fresh step: the restarted exporter
    assert counts(step, events) == expected


def test_a_pods_count_outlives_its_cgroup_and_its_mounts_in_node_mode() -> None:
    """Node mode: the pod's cgroup gone (its read failed, or the pod deleted with its mounts),
    its count stays; a kill in a pod never seen is counted under the pod cgroup the kernel
    named, not under its container (a series per container that died)."""
    step, targets = step_with_pod_mount(POD)
    assert counts(step, [logged(1), v2_counter(1)]) == [1, 1]
    step.accept(Observation("cgroup", None, "ENOENT", 0.0))
    assert counts(step, [logged()]) == [1]
    targets.clear()
    legacy = [k for k in fixture_kills() if k.pod_uid == OTHER_POD]
    step.accept(Observation("oom", OomReports(tuple(legacy), 0), None, 0.0))
    series = {c.cgroup: c.kills for c in step.current().oom_kills}
    assert series == {POD_CGROUP: 1, f"/kubepods/besteffort/pod{OTHER_POD}": 1}


def test_a_sidecar_counts_its_own_cgroups_kills_and_no_other_pods() -> None:
    """Outside node mode the one watched cgroup counts the kills below it, and keeps its count
    when it can no longer be read; another pod's kill in the node's kernel log makes no series."""
    step = ModelStep(["cgroup", "oom"], StateStore())
    step.accept(Observation("discovery", MountSet([Target("/dev/shm", {})]), None, 0.0))
    watched = CgroupMemory(POD_CGROUP, 2, 0, None, 0, None, 0, "none")
    step.accept(Observation("cgroup", [watched], None, 0.0))
    others = tuple(k for k in fixture_kills() if k.task_memcg != CONTAINER)  # the same pod's UID on systemd too
    step.accept(Observation("oom", OomReports((kill(1), *others), 0), None, 0.0))
    assert [(c.cgroup, c.kills) for c in step.current().oom_kills] == [(POD_CGROUP, 1)]
    step.accept(Observation("cgroup", None, "ENOENT", 0.0))  # the workload's cgroup gone, or unread
    assert [(c.cgroup, c.kills) for c in step.current().oom_kills] == [(POD_CGROUP, 1)]


# --- a real restart: real kills, the real kernel log, a real v1 pod and container cgroup ----
NODE = ("--mode=node", "--no-collector.gpu", "--no-collector.segments", "--no-collector.sysv", "--poll-interval=200ms")


def held(exporter: Exporter, uid: str, kills: int, polls: int = 5) -> None:
    """The pod's series (by its pod_uid: node mode names a pod's cgroup so) reaches `kills`
    and stays there for a few polls (a second source seeing the same kill would move it on)."""
    exporter.wait_for(lambda s: value(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == kills, timeout=20)
    for _ in range(polls):
        time.sleep(0.2)
        assert value(exporter.scrape(), "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == kills


def announced(exporter: Exporter, pid: int) -> int:
    """How many times the exporter's log reported the kill of `pid`."""
    with open(exporter.stderr_path, errors="replace") as f:
        return sum(1 for line in f if f"pid {pid} " in line and "OOM kill" in line)


@needs_root
def test_a_restart_counts_no_kill_twice_and_the_next_one_once() -> None:
    """Exporter A sees a kill in the container (the kernel log and the container's counter:
    1). B, started after it, reads the kernel log from its end: 1 from the counter, the kill
    not announced again; B sees a second kill: 2, not 3; the container's cgroup removed: 2."""
    with pod_with_a_container() as (uid, _, ctr_dir, _):
        with Exporter(*NODE) as first:
            held(first, uid, 0, polls=0)
            before = kill_a_hog_in(ctr_dir)
            held(first, uid, 1)
            assert announced(first, before.pid) == 1
        with Exporter(*NODE) as second:
            held(second, uid, 1)
            assert announced(second, before.pid) == 0
            after = kill_a_hog_in(ctr_dir)
            held(second, uid, 2)
            assert announced(second, after.pid) == 1
            remove_cgroup(ctr_dir)
            held(second, uid, 2)
            s = second.scrape()
        assert [labels for labels, _ in select(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid)] == [{"pod_uid": uid}]
