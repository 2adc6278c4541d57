"""The scheduler: a thread per source, so that a hung one (a GPU off the bus, a stuck mount)
delays no other, and a watchdog that publishes a run past its timeout as failed.

Each source runs as it declares (collectors/source.py): a full run every interval (stretched
while a heavy source's result stays the same), and for an event-driven source a quick run
soon after inotify reports a change (debounced) with a full run after it. Each run is handed
a RunInput and its result is published, as an Observation, to the subscribers (the run
inputs first, then the watcher, the model step, the memory give-back) on the thread that ran
it. docs/architecture.md.

Threads: each source's own (`_Runner.run`: every run, its publication), a staged full
run's scan (`_Runner._scan_thread`), the watchdog (`Sampler._watch_timeouts`), and the
callers of Sampler's methods (the watcher's inotify thread asks for runs). What they share
of a runner is in its `_Shared`, under the Sampler's lock; a run's publication and the
watchdog's verdict on it are made one at a time (`_Runner.publishing`).
"""

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set

from exporter.collectors.source import STRETCH_MAX, RunInput, Source, StagedRun
from exporter.host.said import SaidOnce
from exporter.inventory.changes import ChangeLog
from exporter.model.types import Observation
from exporter.runtime.inputs import RunInputs

log = logging.getLogger(__name__)

DEBOUNCE_SECONDS = 0.02  # a quick run starts once a burst of events is quiet this long,
DEBOUNCE_MAX_SECONDS = 0.1  # or this long after its first event
FOLLOW_UP_SECONDS = 1.0  # a full run this soon after a burst's quick run (follows_up)
QUICK_GAP_SECONDS = 0.25  # quick runs this far apart at least (a writer never stops)
WATCHDOG_SECONDS = 0.5  # how often runs are checked against timeouts (seconds long)
INF = float("inf")

Subscriber = Callable[[Observation], None]


@dataclass
class _Shared:
    """What other threads read or write of one runner, under the Sampler's lock."""

    interval: float  # between full runs now: the base, or stretched
    # Of a burst of events not run yet. While it is set the runner's sleep ends by the
    # burst's quick run (or the scan's end): a later event only puts that run off, and wakes
    # no one. Only the runner's thread clears it, and reckons its sleep again after.
    first_event: Optional[float] = None
    last_event: float = 0.0  # the burst's latest
    full_now: bool = False  # events were lost: a full run at once
    # When the oldest run not ended began (a staged full run's while its scan runs): the
    # watchdog's to time. None: none is running.
    running_since: Optional[float] = None
    timed_out: bool = False  # the watchdog published that run as failed
    runs: int = 0  # runs published
    fulls: int = 0  # full runs published whole (not failed)


@dataclass
class _Scan:
    """A staged full run's scan, running on a thread of its own."""

    staged: StagedRun
    started: float  # when its full run began
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None  # the scan raised (it should not)


class _Runner(threading.Thread):
    """One source's thread (`run`) and what it keeps between runs."""

    def __init__(
        self, sampler: "Sampler", source: Source, interval: float, timeout: float
    ) -> None:
        """Made by the Sampler on the thread that builds it; its thread starts at
        `start`."""
        super().__init__(name=f"shmwatch-{source.name}", daemon=True)
        self.sampler, self.source, self.timeout = sampler, source, timeout
        self.base = interval
        self.shared = _Shared(interval=interval)
        self.changes = ChangeLog()  # names inotify saw change, until a run takes them
        self.wake = threading.Event()
        # Held while a run's end, or the watchdog's verdict on it, is published.
        self.publishing = threading.Lock()
        # The runner's thread alone reads and writes these.
        self.last_full = -INF  # when the last full run began
        self.follow_up_at = INF  # a full run due after a quick one (INF: none)
        self.quick_not_before = 0.0
        self.last_result: object = None  # the last full run's, for stretching
        # A staged full run's scan running beside quick runs (None: none).
        self.scanning: Optional[_Scan] = None

    @property
    def interval(self) -> float:
        """Between full runs now (the base, or stretched); any thread, under the lock."""
        with self.sampler.lock:
            return self.shared.interval

    @property
    def runs(self) -> int:
        """Runs published; any thread, under the lock."""
        with self.sampler.lock:
            return self.shared.runs

    def run(self) -> None:
        """The source's thread: what is due, run; then asleep until the next is due or a
        request (an event, the scan's end, a stop) wakes it."""
        while not self.sampler.stopping.is_set():
            self.wake.clear()  # before reading the state: a request after this wakes the wait
            wait = self._run_what_is_due(self.sampler.clock())
            if wait > 0:
                self.wake.wait(wait)

    def run_once(self, full: bool) -> None:
        """One run now, on the calling thread: `Sampler.start`'s (the App's, before any
        source's thread starts) or a test's; never the source's own (`run` is)."""
        if full:
            self._full_run(self.sampler.clock())
        else:
            self._quick_run()

    def _run_what_is_due(self, now: float) -> float:
        """The source's thread: runs one thing that is due (a staged run's finish, a full
        run, a quick run): -> 0, or the seconds until the next is due."""
        scan = self.scanning
        if scan is not None and scan.done.is_set():
            self._finish_staged(scan)
            return 0.0
        if scan is None and self._full_due(now):
            self._full_run(now)
            return 0.0
        quick_at = self._quick_due_at()
        if quick_at is not None and now >= quick_at:
            self._quick_run()
            return 0.0
        # While a scan runs its end wakes us; a full run waits for it.
        next_full = now + self.interval if scan is not None else self._next_full_at()
        return max(0.0, min(next_full, INF if quick_at is None else quick_at) - now)

    def _next_full_at(self) -> float:
        """The source's thread: when the next full run is due, an interval after the last,
        or a quick run's follow-up."""
        return min(self.last_full + self.interval, self.follow_up_at)

    def _full_due(self, now: float) -> bool:
        """The source's thread: a full run is due by the clock, or asked for (events
        lost)."""
        with self.sampler.lock:
            full_now = self.shared.full_now
        return full_now or now >= self._next_full_at()

    def _quick_due_at(self) -> Optional[float]:
        """The source's thread: when the pending burst's quick run is due. None: no burst,
        or a staged full run's scan is running and either timed out (the watchdog's failure
        stands) or is the first full run's (a quick run would have no owners to reuse)."""
        with self.sampler.lock:
            first, last = self.shared.first_event, self.shared.last_event
            fails = self.shared.timed_out or not self.shared.fulls
        if first is None or self.scanning is not None and fails:
            return None
        settled = min(last + DEBOUNCE_SECONDS, first + DEBOUNCE_MAX_SECONDS)
        return max(settled, self.quick_not_before)

    def _input(self, take: bool) -> RunInput:
        """The source's thread: this run's input; `take`: the names inotify saw change are
        this run's (drained), else only looked at."""
        changes = self.changes.drain() if take else self.changes.peek()
        return self.sampler.inputs.make(changes)

    def _begin(self, started: float) -> None:
        """The source's thread: a run begins, and the watchdog times it from now (or from
        the start of the scan still running, whose timeout stands: so `_finish_staged` calls
        this before it clears `scanning`)."""
        with self.sampler.lock:
            scan = self.scanning
            self.shared.timed_out = self.shared.timed_out and scan is not None
            self.shared.running_since = scan.started if scan else started

    def _full_run(self, now: float) -> None:
        """The source's thread (or `Sampler.start`'s, for `first`): a full run, whole or
        staged, published (a staged run with its scan beside quick runs is published by
        `_finish_staged`). It does all a pending quick run would: it takes the same change
        log, unless its scan runs beside quick runs (they take the names then)."""
        beside = self.source.scans_beside_quick_runs
        with self.sampler.lock:
            burst, self.shared.first_event = self.shared.first_event, None
            self.shared.full_now = False
        self.follow_up_at, self.last_full = INF, now
        started = self.sampler.clock()
        self._begin(started)
        run = self._input(take=not beside)
        try:
            staged = self.source.begin_full(run)
            if staged is None:
                result = self.source.collect(run)
            elif beside:
                self._start_scan(staged, started, burst)
                return  # published when it finishes
            else:
                staged.scan()
                run = self._input(take=False)
                result = staged.finish(run)
        except Exception as err:  # one source failing must not stop the others
            self._end(True, started, None, _error(err), run)
            return
        self._end(True, started, result, None, run)

    def _start_scan(
        self, staged: StagedRun, started: float, burst: Optional[float]
    ) -> None:
        """The source's thread: starts the staged run's scan on a thread of its own; the
        burst of events the full run found pending is left to the quick runs beside it (or
        after it, when no thread can be had: the run fails, its first stage undone)."""
        scan = _Scan(staged=staged, started=started)
        thread = threading.Thread(
            target=self._scan_thread,
            args=(scan,),
            name=f"{self.name}-full",
            daemon=True,
        )
        with self.sampler.lock:
            if self.shared.first_event is None:
                self.shared.first_event = burst
        try:
            thread.start()
        except Exception:
            staged.abandon()
            raise
        self.scanning = scan  # once started: a thread never started never ends

    def _scan_thread(self, scan: _Scan) -> None:
        """The scan's own thread: then the source's thread finishes the run."""
        try:
            scan.staged.scan()
        except Exception as err:
            scan.error = _error(err)
        finally:
            scan.done.set()
            self.wake.set()

    def _finish_staged(self, scan: _Scan) -> None:
        """The source's thread, once the scan's thread is done: a staged full run's last
        stage, and its publication."""
        self._begin(scan.started)
        self.scanning = None
        run = self._input(take=False)
        try:
            if scan.error is not None:
                raise RuntimeError(scan.error)
            result = scan.staged.finish(run)
        except Exception as err:
            self._end(True, scan.started, None, _error(err), run)
            return
        self._end(True, scan.started, result, None, run)

    def _quick_run(self) -> None:
        """The source's thread: an event-driven run, handed the names changed, published;
        the next is QUICK_GAP_SECONDS away at least, and a full run follows it
        (follows_up)."""
        with self.sampler.lock:
            self.shared.first_event = None
        started = self.sampler.clock()
        self._begin(started)
        run = self._input(take=True)
        try:
            result = self.source.collect_quick(run)
        except Exception as err:
            self._end(False, started, None, _error(err), run)
        else:
            self._end(False, started, result, None, run)
        ended = self.sampler.clock()
        self.quick_not_before = ended + QUICK_GAP_SECONDS
        if self.source.follows_up and self.follow_up_at == INF:
            self.follow_up_at = ended + FOLLOW_UP_SECONDS

    def _stretched(self, result: object, error: Optional[str], run: RunInput) -> bool:
        """The source's thread, after a full run: does a heavy source's interval double?"""
        if error is not None or not self.source.stretches(run):
            return False
        return result == self.last_result

    def _end(
        self,
        full: bool,
        started: float,
        result: object,
        error: Optional[str],
        run: RunInput,
    ) -> None:
        """The source's thread: a run ended, its interval set and its result published,
        ordered with the watchdog's verdict on it (a verdict given first is followed by the
        run's own result; none is given after it ended)."""
        ended = self.sampler.clock()
        # Ended: the watchdog times it no more, before the compare below (a large
        # inventory's takes a while). A quick run beside a scan: the scan still runs.
        with self.sampler.lock:
            scan = self.scanning
            self.shared.running_since = scan.started if scan else None
        if full:
            stretched = self._stretched(result, error, run)
            # Kept for the next full run's comparison only while it may stretch: a storm's
            # inventory is not held past its publication.
            self.last_result = result if self.source.stretches(run) else None
            with self.sampler.lock:
                longer = min(self.shared.interval * 2, self.base * STRETCH_MAX)
                self.shared.interval = longer if stretched else self.base
        obs = Observation(
            source=self.source.name,
            result=result,
            error=error,
            duration=ended - started,
            full=full,
        )
        with self.publishing:
            self.sampler.publish(obs)
            with self.sampler.lock:  # after publishing: a waiter finds it in the model
                self.shared.fulls += full and error is None
                self.shared.runs += 1

    def fail_if_overdue(self, now: float) -> None:
        """The watchdog's thread: a run past its timeout is published as failed, once; it
        is left to finish (or not), never started twice. Never waits for a publication: one
        held up by a subscriber (the watcher's stat of a stuck mount) would stop the verdicts
        on every other source."""
        if not self.publishing.acquire(blocking=False):
            return  # a run of this source is publishing its end: looked at next time
        try:
            with self.sampler.lock:
                since = self.shared.running_since
                if (
                    since is None
                    or self.shared.timed_out
                    or now - since <= self.timeout
                ):
                    return
                self.shared.timed_out = True
            error = f"timed out after {self.timeout:g}s"
            self.sampler.publish(
                Observation(
                    source=self.source.name,
                    result=None,
                    error=error,
                    duration=now - since,
                )
            )
        finally:
            self.publishing.release()

    def request(self, full: bool, now: float) -> None:
        """The caller's thread (the watcher's): flags only (the change log is `Sampler.changed`
        and `lost`'s): a quick run soon, or a full run at once and a quick run: a full run
        whose scan runs beside quick runs leaves them the change log (`lost`'s mounts marked
        unknown), which only they take. The runner is woken only when something is due
        sooner than it last reckoned: a burst's first event, events lost, a stretched
        interval back at its base (a burst's later events only put its quick run off)."""
        with self.sampler.lock:
            shared = self.shared
            sooner = (
                shared.first_event is None
                or (full and not shared.full_now)
                or shared.interval != self.base
            )
            shared.full_now = shared.full_now or full
            shared.last_event = now
            if shared.first_event is None:
                shared.first_event = now
            shared.interval = self.base
        if sooner:
            self.wake.set()


def _error(err: Exception) -> str:
    """A failed run's error, as shmwatch_collector_success's log line says it (any
    thread)."""
    return f"{type(err).__name__}: {err}"


class Sampler:
    """The sources' runners, the watchdog, and what the watcher asks of them. Made, and its
    subscribers added, on the thread that builds the App; each method says where it runs."""

    def __init__(
        self,
        sources: Sequence[Source],
        poll_interval: float = 1.0,
        inventory_interval: float = 15.0,
        timeouts: Optional[Dict[str, float]] = None,
        default_timeout: float = 10.0,
        mounts: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """On the App's thread. `mounts`: the runs' until discovery publishes a set;
        `clock`: monotonic seconds."""
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # every runner's `shared`
        self.clock = clock
        self.inputs = RunInputs(mounts)
        self._subscribers: List[Subscriber] = []
        self._said = SaidOnce(log, prefix="collector {} ")  # failing, or recovered
        self._said_lock = threading.Lock()  # runners and the watchdog publish
        self.runners: Dict[str, _Runner] = {}
        for s in sources:
            inventory = s.schedule == "inventory"
            interval = inventory_interval if inventory else poll_interval
            timeout = (timeouts or {}).get(s.name, default_timeout)
            self.runners[s.name] = _Runner(self, s, interval, timeout)

    def subscribe(self, subscriber: Subscriber) -> None:
        """On the App's thread, before `start`: `subscriber` is called with every
        observation, in the order subscribed, on the thread that publishes it."""
        self._subscribers.append(subscriber)

    def start(self, first: Sequence[str] = ()) -> None:
        """The caller's thread (the App's): starts a thread per source and the watchdog.
        `first`: sources run once on this thread before any thread starts (discovery:
        every other source's first run is handed the mounts it found)."""
        for name in first:
            self.runners[name].run_once(full=True)
        for runner in self.runners.values():
            runner.start()
        threading.Thread(
            target=self._watch_timeouts, name="shmwatch-watchdog", daemon=True
        ).start()

    def stop(self, wait: float = 1.0) -> Set[str]:
        """The caller's thread (the App's, at shutdown): every runner asked to stop and
        waited for up to `wait` seconds in all -> the sources whose run is still going (left
        to it)."""
        self.stopping.set()
        for runner in self.runners.values():
            runner.wake.set()
        deadline = time.monotonic() + wait
        for runner in self.runners.values():
            if runner.is_alive():
                runner.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            return {
                name
                for name, r in self.runners.items()
                if r.shared.running_since is not None
            }

    def wait_for_first_run(self, timeout: float) -> bool:
        """The caller's thread (`check`, tests): waits until every source's first run is
        published (or failed by the watchdog); False after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                done = all(
                    r.shared.runs or r.shared.timed_out for r in self.runners.values()
                )
            if done:
                return True
            time.sleep(0.01)
        return False

    def request(self, full: bool = False) -> None:
        """The watcher's inotify thread (through `changed` and `lost`): a mount changed:
        event-driven sources run soon (`full`: events were lost, a full
        run at once as well); a stretched one is back at its interval."""
        now = self.clock()
        for runner in self.runners.values():
            if runner.source.event_driven:
                runner.request(full, now)

    def changed(self, mount: str, name: Optional[str]) -> None:
        """The watcher (inotify thread): `name` changed in `mount`'s top directory (None:
        something below it): the event-driven sources' next runs are handed it."""
        for runner in self.runners.values():
            if runner.source.event_driven:
                if name is None:
                    runner.changes.unknown(mount)
                else:
                    runner.changes.add(mount, name)
        self.request()

    def lost(self, mounts: Sequence[str]) -> None:
        """The watcher's inotify thread: events on `mounts` were lost (the queue
        overflowed): each is listed again by a full run at once."""
        for runner in self.runners.values():
            if runner.source.event_driven:
                for mount in mounts:
                    runner.changes.unknown(mount)
        self.request(full=True)

    def watching(self, every_mount: bool) -> None:
        """The watcher's callers' threads: discovery's (the watcher refreshes its watches
        on a published mount set), the App's at start, or the inotify thread (a watch
        dropped): whether inotify watches every mount; later runs are handed it."""
        self.inputs.watching(every_mount)

    def publish(self, obs: Observation) -> None:
        """The publishing thread (a source's, or the watchdog's for a run past its timeout):
        the collector's failure or recovery logged, then the observation handed to the run
        inputs and each subscriber in turn, on that thread."""
        failed = f"failed: {obs.error}" if obs.error else None
        with self._said_lock:
            said = self._said.run(self.runners)
            said.say(obs.source, failed, logging.ERROR, back="recovered")
        self.inputs.on_observation(obs)
        for subscriber in self._subscribers:
            try:
                subscriber(obs)
            except Exception:  # a bug in one subscriber must not end a source's thread
                log.exception("handling %s's observation failed", obs.source)

    def check_timeouts(self) -> None:
        """The watchdog's thread: every run past its timeout published as failed."""
        now = self.clock()
        for runner in self.runners.values():
            runner.fail_if_overdue(now)

    def _watch_timeouts(self) -> None:
        """The watchdog's thread: every WATCHDOG_SECONDS until stopped."""
        while not self.stopping.wait(WATCHDOG_SECONDS):
            self.check_timeouts()
