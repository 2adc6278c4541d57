"""runtime/scheduler.py: what the runners share with other threads. The watchdog's verdict
on a run and the run's own result are published one at a time, in the order they were
given: a healthy run is never left published as timed out (collector_success 0)."""

import threading
import time
from pathlib import Path
from typing import Callable, List

import pytest

from exporter.collectors.segments import SegmentsCollector
from exporter.collectors.source import RunInput, Source
from exporter.model.types import Inventory, Observation
from exporter.runtime.scheduler import Sampler
from tests.unit.collectors.test_segments import Host, states


class Clock:
    """The scheduler's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Blocking(Source):
    """A full run that lasts until the test releases it."""

    name, schedule = "segments", "inventory"

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def collect(self, run: RunInput) -> List[str]:
        self.started.set()
        self.release.wait(10)
        return ["done"]


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.01)
    return condition()


def test_a_run_that_ends_as_the_watchdog_looks_is_published_healthy_last() -> None:
    """The watchdog finds the run past its timeout, and the run ends while the watchdog
    publishes its verdict (the barrier below). The run's own result comes after the verdict,
    so the model's last word is the healthy run's. (Published outside the runner's lock, the
    verdict lands after the run's result: the healthy run reads as timed out until it runs
    again, 15 s to 2 minutes later.)"""
    clock, source, seen = Clock(), Blocking(), []
    run_published = threading.Event()
    sampler = Sampler(
        [source], inventory_interval=3600.0, default_timeout=10.0, clock=clock
    )

    def the_run_ends_meanwhile(obs: Observation) -> None:
        if obs.error and obs.error.startswith("timed out"):
            source.release.set()
            run_published.wait(0.5)  # in vain: the run's end waits for this publication

    def model(obs: Observation) -> None:
        seen.append(obs)
        if obs.error is None:
            run_published.set()

    sampler.subscribe(the_run_ends_meanwhile)
    sampler.subscribe(model)
    runner = sampler.runners["segments"]
    runner.start()
    try:
        assert source.started.wait(10)
        clock.now += 11  # past its timeout
        sampler.check_timeouts()  # the watchdog looks (on this thread)
        assert wait_until(lambda: len(seen) == 2), seen
        assert [o.error for o in seen] == ["timed out after 10s", None]
        assert seen[-1].result == ["done"]
        sampler.check_timeouts()
        assert len(seen) == 2  # the run ended: no verdict on it any more
    finally:
        source.release.set()
        sampler.stop()


def test_a_run_that_ended_before_the_watchdog_looks_is_not_failed() -> None:
    clock, source = Clock(), Blocking()
    seen: List[Observation] = []
    sampler = Sampler(
        [source], inventory_interval=3600.0, default_timeout=10.0, clock=clock
    )
    sampler.subscribe(seen.append)
    runner = sampler.runners["segments"]
    runner.start()
    try:
        assert source.started.wait(10)
        clock.now += 11  # it took longer than its timeout ...
        source.release.set()
        assert wait_until(lambda: len(seen) == 1)
        sampler.check_timeouts()  # ... but ended before the watchdog looked
        assert [o.error for o in seen] == [None] and seen[0].duration == 11
        assert sampler.wait_for_first_run(1) and runner.runs == 1
    finally:
        sampler.stop()


def test_a_hung_run_is_failed_once_and_its_end_recovers_it() -> None:
    clock, source = Clock(), Blocking()
    seen: List[Observation] = []
    sampler = Sampler(
        [source], inventory_interval=3600.0, default_timeout=10.0, clock=clock
    )
    sampler.subscribe(seen.append)
    sampler.runners["segments"].start()
    try:
        assert source.started.wait(10)
        clock.now += 10
        sampler.check_timeouts()
        assert seen == []  # at its timeout, not past it
        clock.now += 1
        sampler.check_timeouts()
        sampler.check_timeouts()
        assert [o.error for o in seen] == ["timed out after 10s"]
        assert sampler.wait_for_first_run(1)  # a failed run counts as run for `check`
        source.release.set()
        assert wait_until(lambda: len(seen) == 2) and seen[-1].error is None
    finally:
        source.release.set()
        sampler.stop()


class Discovery(Source):
    """A source whose runs end at once."""

    name, schedule = "discovery", "poll"

    def collect(self, run: RunInput) -> List[str]:
        return []


def test_a_publication_held_up_by_a_subscriber_stops_no_other_sources_verdict() -> None:
    """Discovery's publication is held up in a subscriber (the watcher refreshing its
    watches stats a stuck mount) while the segments run hangs past its timeout: the watchdog
    still publishes the segments run as failed. (Waiting for every runner's publication in
    turn, it waited on discovery's for as long as it lasted: no source was failed.)"""
    clock, discovery, source = Clock(), Discovery(), Blocking()
    seen: List[Observation] = []
    held, release = threading.Event(), threading.Event()
    sampler = Sampler(
        [discovery, source],
        poll_interval=3600.0,
        inventory_interval=3600.0,
        default_timeout=10.0,
        clock=clock,
    )

    def stuck_watcher(obs: Observation) -> None:
        if obs.source == "discovery":
            held.set()
            release.wait(10)

    sampler.subscribe(stuck_watcher)
    sampler.subscribe(seen.append)
    for runner in sampler.runners.values():
        runner.start()
    try:
        assert held.wait(10) and source.started.wait(10)
        clock.now += 11  # the segments run is past its timeout
        watchdog = threading.Thread(target=sampler.check_timeouts, daemon=True)
        watchdog.start()
        assert wait_until(lambda: bool(seen), timeout=5), "no verdict published"
        assert [(o.source, o.error) for o in seen] == [
            ("segments", "timed out after 10s")
        ]
    finally:
        release.set()
        source.release.set()
        sampler.stop()


def test_lost_events_on_a_quiet_node_leave_no_leak_unsettled(tmp_path: Path) -> None:
    """Node mode, an inotify queue overflow (`lost`) and then no event: the mount marked
    unknown is taken by a quick run, and the next full runs settle it: the leak is called
    orphan again. (Asked for a full run only, the marks stayed in the change log, which a
    node's full runs leave to quick runs: every full run judged the mount changed during
    its scan, and the leak was never called leaked while the node stayed quiet.)"""
    host = Host(tmp_path, ["shm"])
    [shm] = host.mounts
    host.file(0, "psm_leak")
    host.holder(101, comm="bash")
    source = SegmentsCollector(host.proc.paths, pod_of_pid=True)
    sampler = Sampler([source], inventory_interval=0.2, mounts=host.mounts)
    fulls: List[str] = []  # the leak's state in each full run published

    def model(obs: Observation) -> None:
        if obs.full and isinstance(obs.result, Inventory):
            fulls.append(states(obs.result, shm)["psm_leak"][1])

    sampler.subscribe(model)
    sampler.start()
    try:
        assert wait_until(lambda: "orphan" in fulls), fulls
        sampler.lost([shm])
        before = len(fulls)
        assert wait_until(lambda: len(fulls) >= before + 4), fulls
        assert "orphan" in fulls[before : before + 4], fulls
    finally:
        sampler.stop()


def test_a_scan_thread_that_cannot_start_leaves_the_pending_names_to_a_quick_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node mode: a full run finds names pending, and its scan's thread cannot start (no
    thread to be had). The run fails; the names are still the next quick run's, at once (the
    burst was dropped: nothing listed them until the next event or full run), and no scan
    is taken to be reading /proc."""
    host = Host(tmp_path, ["shm"])
    [shm] = host.mounts
    source = SegmentsCollector(host.proc.paths, pod_of_pid=True)
    sampler = Sampler([source], inventory_interval=60, mounts=host.mounts)
    seen: List[Observation] = []
    sampler.subscribe(seen.append)
    sampler.start()
    real, refused = threading.Thread.start, []

    def start(thread: threading.Thread) -> None:
        if thread.name.endswith("-full") and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        real(thread)

    try:
        assert wait_until(lambda: any(o.full and o.result for o in seen))
        monkeypatch.setattr(threading.Thread, "start", start)
        host.file(0, "psm_new")
        sampler.changed(shm, "psm_new")
        sampler.request(full=True)  # a full run first, the burst pending
        listed = lambda: any(  # noqa: E731
            isinstance(o.result, Inventory) and "psm_new" in states(o.result, shm)
            for o in seen
        )
        assert wait_until(listed, timeout=5), [(o.full, o.error) for o in seen]
        assert refused and any("can't start new thread" in (o.error or "") for o in seen)
        assert source._during is None
    finally:
        sampler.stop()


class SlowToCompare:
    """A full run's result whose comparison with the last (does the interval stretch?)
    lasts until the test releases it, as a large inventory's takes a while."""

    def __init__(self) -> None:
        self.comparing, self.release = threading.Event(), threading.Event()

    def __eq__(self, other: object) -> bool:
        self.comparing.set()
        self.release.wait(10)
        return other is self

    __hash__ = object.__hash__


class Stretching(Source):
    """A heavy source whose runs end at once, with a result slow to compare."""

    name, schedule = "segments", "inventory"

    def __init__(self) -> None:
        self.result = SlowToCompare()

    def stretches(self, run: RunInput) -> bool:
        return True

    def collect(self, run: RunInput) -> SlowToCompare:
        return self.result


def test_a_run_that_ended_in_time_is_not_failed_while_its_result_is_compared() -> None:
    """The run returned inside its timeout; the watchdog looks while the scheduler compares
    its result with the last one: no verdict. (Timed until it was published, the run was
    published as timed out first.)"""
    clock, source = Clock(), Stretching()
    seen: List[Observation] = []
    sampler = Sampler(
        [source], inventory_interval=3600.0, default_timeout=10.0, clock=clock
    )
    sampler.subscribe(seen.append)
    sampler.runners["segments"].start()
    try:
        assert source.result.comparing.wait(10)
        clock.now += 11
        sampler.check_timeouts()
        source.result.release.set()
        assert wait_until(lambda: bool(seen))
        assert [o.error for o in seen] == [None] and seen[0].duration == 0
    finally:
        source.result.release.set()
        sampler.stop()


def test_only_what_brings_a_run_sooner_wakes_its_runner() -> None:
    """Every inotify event woke the event-driven runners, which reckoned again and slept
    again: a burst's later events only put its quick run off. Its first event, lost events
    and a stretched interval back at its base each bring a run sooner."""

    class Watched(Blocking):
        event_driven = True

    clock = Clock()
    sampler = Sampler([Watched()], inventory_interval=15.0, clock=clock)
    runner = sampler.runners["segments"]  # not started: its wake is what the test reads

    def woken_by(full: bool = False) -> bool:
        runner.wake.clear()
        sampler.request(full)
        return runner.wake.is_set()

    assert woken_by()  # a burst's first event
    clock.now += 0.05
    assert not woken_by() and not woken_by()  # its later events
    assert woken_by(full=True) and not woken_by(full=True)  # events lost, once
    with sampler.lock:
        runner.shared.first_event, runner.shared.interval = None, 60.0  # a quick run took it; stretched
    assert woken_by()
    with sampler.lock:
        runner.shared.interval = 60.0  # stretched again, mid-burst
    assert woken_by()
    assert runner.shared.interval == 15.0 and runner.shared.last_event == clock.now
