"""Tests of exporter/runtime/scheduler_timing.py."""

import threading
import time

from exporter.collectors.source import Source
from exporter.runtime import scheduler as scheduler_mod
from exporter.runtime.scheduler import Sampler


class Counting(Source):
    """A source that counts its runs (and quick runs)."""

    def __init__(self, name, schedule="poll", event_driven=False, stretches=False, result=None):
        self.name = name
        self.schedule = schedule
        self.event_driven = event_driven
        self.stretchy = stretches
        self.result = result if result is not None else (lambda: [])
        self.runs = []
        self.quick = []
        self.lock = threading.Lock()
        self.duration = 0.0

    def stretches(self, run):
        return self.stretchy

    def collect(self, run):
        with self.lock:
            self.runs.append(time.monotonic())
        time.sleep(self.duration)
        return self.result()

    def collect_quick(self, run):
        with self.lock:
            self.quick.append(time.monotonic())
        return self.result()


def wait_until(condition, timeout=20.0):
    """Conditions, not sleeps: a loaded machine delays runs, and a generous deadline is
    only reached when the condition never comes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_every_source_keeps_its_interval():
    fast, slow = Counting("fast"), Counting("slow", schedule="inventory")
    sampler = Sampler([fast, slow], poll_interval=0.2, inventory_interval=1.0)
    sampler.start()
    try:
        assert wait_until(lambda: len(fast.runs) >= 8 and len(slow.runs) >= 2)
    finally:
        sampler.stop()
    # Never early: the k-th run no sooner than k intervals after the first.
    assert all(t - fast.runs[0] >= k * 0.2 - 0.02 for k, t in enumerate(fast.runs))
    assert slow.runs[1] - slow.runs[0] >= 1.0 - 0.02
    # And not stretched: seven intervals take well under what the slow source's two would.
    assert fast.runs[7] - fast.runs[0] < 7 * 0.2 * 2


def test_a_burst_of_events_is_one_debounced_quick_run_then_a_full_run():
    source = Counting("segments", schedule="inventory", event_driven=True)
    other = Counting("host_memory", schedule="inventory")
    sampler = Sampler([source, other], inventory_interval=60.0)
    sampler.start()
    try:
        assert wait_until(lambda: len(source.runs) == 1 and len(other.runs) == 1)  # the first full runs
        burst = time.monotonic()
        for _ in range(10):  # one burst, events 5 ms apart
            sampler.request()
            time.sleep(0.005)
        assert wait_until(lambda: source.quick)
        assert len(source.runs) == 1
        # Within the debounce's bound after the first event (generously: a loaded machine).
        assert source.quick[0] - burst <= scheduler_mod.DEBOUNCE_MAX_SECONDS + 0.5
        assert wait_until(lambda: len(source.runs) == 2)  # the follow-up full run
        assert 1 <= len(source.quick) <= 2  # two if the burst outlasted the debounce's bound
        # FOLLOW_UP_SECONDS after the first quick run (a second one, under load, does not move it).
        assert source.runs[1] - source.quick[0] >= scheduler_mod.FOLLOW_UP_SECONDS - 0.05
        assert other.quick == [] and len(other.runs) == 1  # not event-driven: left alone
    finally:
        sampler.stop()


def test_events_during_a_full_run_get_a_quick_run_after_it():
    source = Counting("segments", schedule="inventory", event_driven=True)
    source.duration = 0.4
    sampler = Sampler([source], inventory_interval=60.0)
    sampler.start()
    try:
        assert wait_until(lambda: source.runs)  # inside the first full run (0.4 s)
        sampler.request()
        assert wait_until(lambda: source.quick)
        assert len(source.runs) == 1 and len(source.quick) == 1
        assert source.quick[0] >= source.runs[0] + 0.4
    finally:
        sampler.stop()


def test_a_lost_event_queue_asks_for_a_full_run_at_once():
    source = Counting("segments", schedule="inventory", event_driven=True)
    sampler = Sampler([source], inventory_interval=60.0)
    sampler.start()
    try:
        assert wait_until(lambda: source.runs)
        sampler.request(full=True)
        assert wait_until(lambda: len(source.runs) == 2)
        assert source.quick == []
    finally:
        sampler.stop()


def test_a_heavy_source_stretches_its_interval_while_nothing_changes():
    value = {"v": 1}
    steady = Counting("cgroup", stretches=True, result=lambda: [value["v"]])
    plain = Counting("sysv", result=lambda: [1])
    sampler = Sampler([steady, plain], poll_interval=0.1)
    sampler.start()
    try:
        # By the plain source's twentieth run (2 s), the steady one ran at 0, 0.1 (same:
        # 0.2), 0.3 (0.4), 0.7 (0.8 = the cap), 1.5: five, not twenty.
        assert wait_until(lambda: len(plain.runs) >= 20)
        assert 3 <= len(steady.runs) <= 6
        assert wait_until(lambda: len(steady.runs) >= 6)
        gaps = [b - a for a, b in zip(steady.runs, steady.runs[1:])]
        assert max(gaps) <= 0.1 * scheduler_mod.STRETCH_MAX + 0.5
        assert gaps[-1] >= 0.1 * scheduler_mod.STRETCH_MAX - 0.02  # at the cap
        value["v"] = 2  # a change: back to the base interval after the next run
        changed = len(steady.runs)  # every run from here on sees it
        assert wait_until(lambda: len(steady.runs) >= changed + 2)
        # The run that saw it comes back after the base interval (0.1 s), not the cap's 0.8 s.
        assert steady.runs[changed + 1] - steady.runs[changed] < 0.1 * scheduler_mod.STRETCH_MAX
    finally:
        sampler.stop()


def test_an_event_brings_a_stretched_source_back_to_its_interval():
    steady = Counting("segments", event_driven=True, stretches=True, result=lambda: [1])
    sampler = Sampler([steady], poll_interval=0.1)
    sampler.start()
    try:
        runner = sampler.runners["segments"]
        assert wait_until(lambda: runner.interval == 0.1 * scheduler_mod.STRETCH_MAX)
        sampler.request()
        assert runner.interval == 0.1
    finally:
        sampler.stop()


def test_stopping_ends_every_runner_promptly():
    sources = [Counting(f"s{i}", schedule="inventory", event_driven=True) for i in range(3)]
    sampler = Sampler(sources, inventory_interval=60.0)
    sampler.start()
    assert wait_until(lambda: all(s.runs for s in sources))
    sampler.request()
    started = time.monotonic()
    sampler.stop()
    assert time.monotonic() - started < 0.5
    assert not any(r.is_alive() for r in sampler.runners.values())


def test_a_source_that_stops_stretching_is_back_at_its_interval():
    """A watch lost (node-mode segments: the mount is polled now) or the kernel log failing
    (node-mode cgroups) ends the stretch at the next full run, not at the next event."""
    steady = Counting("segments", stretches=True, result=lambda: [1])
    runner = Sampler([steady], poll_interval=0.02).runners["segments"]
    for _ in range(6):
        runner.run_once(full=True)
    assert runner.interval == 0.02 * scheduler_mod.STRETCH_MAX
    steady.stretchy = False
    runner.run_once(full=True)
    assert runner.interval == 0.02


def test_a_run_is_counted_only_once_its_observation_is_published():
    """`shmwatch check` waits on the runs, then reads the model: it must find each result."""
    source = Counting("segments")
    sampler = Sampler([source])
    seen_at_publish = []
    sampler.subscribe(lambda obs: seen_at_publish.append(sampler.runners["segments"].runs))
    sampler.runners["segments"].run_once(full=True)
    assert seen_at_publish == [0] and sampler.runners["segments"].runs == 1


def test_events_that_never_stop_get_spaced_quick_runs_and_their_follow_up_in_time():
    """A writer appending to a file in /dev/shm for ever: quick runs stay QUICK_GAP_SECONDS
    apart at least, and the follow-up full run (owners from /proc: leaked vs linked) comes
    FOLLOW_UP_SECONDS after the first quick run, not after the events stop."""
    source = Counting("segments", schedule="inventory", event_driven=True)
    sampler = Sampler([source], inventory_interval=60.0)
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            sampler.request()
            time.sleep(0.01)

    sampler.start()
    thread = threading.Thread(target=writer)
    try:
        assert wait_until(lambda: len(source.runs) == 1)
        thread.start()
        assert wait_until(lambda: len(source.runs) >= 2, timeout=scheduler_mod.FOLLOW_UP_SECONDS + 2.0)
        assert source.runs[1] - source.quick[0] <= scheduler_mod.FOLLOW_UP_SECONDS + 0.5
        assert wait_until(lambda: len(source.quick) >= 5)
        gaps = [b - a for a, b in zip(source.quick, source.quick[1:])]
        assert gaps and min(gaps) >= scheduler_mod.QUICK_GAP_SECONDS - 0.01
    finally:
        stop.set()
        thread.join() if thread.is_alive() else None
        sampler.stop()


class Staged(Source):
    """A full run in stages (as segments in node mode): its scan waits for `release`."""

    name, schedule, event_driven = "segments", "inventory", True
    scans_beside_quick_runs = True

    def __init__(self):
        self.release = threading.Event()

    def collect_quick(self, run):
        return "quick"

    def begin_full(self, run):
        return self

    def scan(self):
        self.release.wait()

    def finish(self, run):
        return "full"

    def abandon(self):
        self.abandoned = True


def test_a_hung_staged_scan_stays_failed_and_no_quick_run_hides_it():
    source, seen = Staged(), []
    sampler = Sampler([source], inventory_interval=0.3, default_timeout=0.5)
    sampler.subscribe(seen.append)
    sampler.start()
    try:
        for _ in range(8):  # events before and after the timeout
            time.sleep(0.2)
            sampler.request()
        assert wait_until(lambda: any(o.error for o in seen))
        assert [o.result for o in seen] == [None], "nothing runs before the first scan ends, nor after its timeout"
        source.release.set()
        assert wait_until(lambda: seen[-1].result == "full" and not seen[-1].error)  # it ended: recovered
    finally:
        source.release.set()
        sampler.stop()


def test_a_staged_scan_whose_thread_cannot_start_fails_once_and_the_next_runs(monkeypatch):
    source, seen = Staged(), []
    source.release.set()
    real, failed = threading.Thread.start, []

    def start(thread):
        if thread.name.endswith("-full") and not failed:
            failed.append(thread.name)
            raise RuntimeError("can't start new thread")
        return real(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    sampler = Sampler([source], inventory_interval=0.2)
    sampler.subscribe(seen.append)
    sampler.start()
    try:
        assert wait_until(lambda: sum(o.result == "full" for o in seen) >= 2)
        assert "can't start new thread" in seen[0].error
        assert source.abandoned
    finally:
        sampler.stop()


def test_a_failing_source_is_logged_when_it_starts_failing_changes_and_recovers(caplog):
    """Not on every run: a collector failing every poll for an hour is one line, not 3,600."""
    errors = [ValueError("mount gone"), ValueError("mount gone"), OSError("EIO"), None, None]

    def result():
        error = errors.pop(0)
        if error:
            raise error
        return []

    runner = Sampler([Counting("shm_mount", result=result)]).runners["shm_mount"]
    with caplog.at_level("INFO", logger=scheduler_mod.log.name):
        for _ in range(5):
            runner.run_once(full=True)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "collector shm_mount failed: ValueError: mount gone"),
        ("ERROR", "collector shm_mount failed: OSError: EIO"),
        ("INFO", "collector shm_mount recovered"),
    ]
