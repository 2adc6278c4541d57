"""A thread per source: a hung one (a GPU off the bus, a stuck mount) delays no other; a
watchdog fails a run past its timeout. Runs as Source declares; docs/architecture.md."""

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Sequence, Set

from exporter.collectors.source import STRETCH_MAX, Source
from exporter.host.said import SaidOnce
from exporter.model.types import Observation

log = logging.getLogger(__name__)

DEBOUNCE_SECONDS = 0.02  # a quick run starts once a burst of events is quiet this long,
DEBOUNCE_MAX_SECONDS = 0.1  # or this long after its first event
FOLLOW_UP_SECONDS = 1.0  # a full run this soon after a burst's quick run (follows_up)
QUICK_GAP_SECONDS = 0.25  # quick runs this far apart at least (a writer never stops)
WATCHDOG_SECONDS = 0.5  # how often runs are checked against timeouts (seconds long)
INF = float("inf")


class _Runner(threading.Thread):
    def __init__(self, sampler, source: Source, interval: float, timeout: float):
        super().__init__(name=f"shmwatch-{source.name}", daemon=True)
        self.sampler, self.source, self.timeout = sampler, source, timeout
        self.base = self.interval = interval
        self.wake = threading.Event()
        self.first_event: Optional[float] = None  # of a burst not run yet
        self.last_event = self.quick_not_before = 0.0
        self.follow_up_at = INF  # none pending
        self.last_full = -INF  # when the last full run started
        self.last_result: object = None  # of the last full run, for stretching
        self.running_since: Optional[float] = None
        self.full_now = self.timed_out = False
        self.runs = self.fulls = 0  # fulls: full runs published whole
        self.middle: Optional[Future] = None  # a full run's middle, beside quick runs

    def run(self) -> None:
        while not self.sampler.stopping.is_set():
            self.wake.clear()  # before reading the state: a request after this wakes the wait
            now = time.monotonic()
            next_full = min(self.last_full + self.interval, self.follow_up_at)
            if self.middle is not None:
                if self.middle.done():
                    self.run_once(full=True)  # its last step
                    continue
                next_full = now + self.interval  # the middle wakes us when it ends
            elif self.full_now or now >= next_full:
                # A full run does all a pending event-driven run would: it drains the same
                # change log (a staged one leaves it to the quick runs beside it).
                events, self.first_event = self.first_event, None
                self.full_now, self.follow_up_at, self.last_full = False, INF, now
                self.run_once(full=True)
                if self.middle:  # its first step left the change log to quick runs
                    self.first_event = self.first_event or events
                continue
            # No quick run beside a hung middle (as a hung collect(): the watchdog's failure
            # stands) nor before the first full run (it would have no owners).
            held = self.middle is not None and (self.timed_out or not self.fulls)
            if self.first_event is not None and not held:
                quiet = self.last_event + DEBOUNCE_SECONDS
                at_most = self.first_event + DEBOUNCE_MAX_SECONDS
                due = max(min(quiet, at_most), self.quick_not_before)
                if now >= due:
                    self.first_event = None
                    self.run_once(full=False)
                    ended = time.monotonic()
                    self.quick_not_before = ended + QUICK_GAP_SECONDS
                    if self.source.follows_up and self.follow_up_at == INF:
                        self.follow_up_at = ended + FOLLOW_UP_SECONDS
                    continue
                next_full = due
            self.wake.wait(max(0.0, next_full - now))

    def run_once(self, full: bool) -> None:
        started = time.monotonic()
        # The watchdog times the oldest run not ended: a full run whose middle is running.
        self.timed_out = self.timed_out and self.middle is not None
        self.running_since = self.middle.started if self.middle else started
        try:
            if full and self.middle:
                middle, self.middle, started = self.middle, None, self.middle.started
                result = middle.result()()
            elif full and (job := self.source.begin_full()) is not None:
                middle, name = Future(), f"{self.name}-full"
                middle.started = started
                threading.Thread(
                    target=self._middle, args=(job, middle), name=name
                ).start()
                self.middle = middle  # once started: a thread never started never ends
                return
            else:
                result = self.source.collect() if full else self.source.collect_quick()
            error = None
        except Exception as err:  # one source failing must not stop the others
            result, error = None, f"{type(err).__name__}: {err}"
        self.running_since = self.middle.started if self.middle else None
        if full:
            same = self.source.stretches and not error and result == self.last_result
            longer = min(self.interval * 2, self.base * STRETCH_MAX)
            self.interval, self.last_result = longer if same else self.base, result
        took = time.monotonic() - started
        self.sampler.publish(Observation(self.source.name, result, error, took, full))
        self.fulls += full and error is None
        self.runs += 1  # after publishing: a waiter finds the result in the model

    def _middle(self, job: Callable, middle: Future) -> None:  # daemon, as its runner
        try:
            middle.set_result(job())
        except Exception as err:
            middle.set_exception(err)
        self.wake.set()


class Sampler:
    def __init__(
        self,
        sources: Sequence[Source],
        poll_interval: float = 1.0,
        inventory_interval: float = 15.0,
        timeouts: Optional[Dict[str, float]] = None,
        default_timeout: float = 10.0,
    ):
        self.stopping = threading.Event()
        self._subscribers: List[Callable[[Observation], None]] = []
        self._said = SaidOnce(log, prefix="collector {} ")  # failing, or recovered
        self._said_lock = threading.Lock()  # the watchdog publishes too
        self.runners: Dict[str, _Runner] = {}
        for s in sources:
            inventory = s.schedule == "inventory"
            interval = inventory_interval if inventory else poll_interval
            timeout = (timeouts or {}).get(s.name, default_timeout)
            self.runners[s.name] = _Runner(self, s, interval, timeout)

    def subscribe(self, subscriber: Callable[[Observation], None]) -> None:
        self._subscribers.append(subscriber)

    def start(self) -> None:
        for runner in self.runners.values():
            runner.start()
        threading.Thread(
            target=self._watch_timeouts, name="shmwatch-watchdog", daemon=True
        ).start()

    def stop(self, wait: float = 1.0) -> Set[str]:  # -> the sources still running
        self.stopping.set()
        for runner in self.runners.values():
            runner.wake.set()
        deadline = time.monotonic() + wait
        for runner in self.runners.values():
            if runner.is_alive():
                runner.join(max(0.0, deadline - time.monotonic()))
        return {name for name, r in self.runners.items() if r.running_since is not None}

    def wait_for_first_run(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(r.runs or r.timed_out for r in self.runners.values()):
                return True
            time.sleep(0.01)
        return False

    def request(self, full: bool = False) -> None:  # a mount changed; full: events lost
        now = time.monotonic()
        for runner in (r for r in self.runners.values() if r.source.event_driven):
            if full:
                runner.full_now = True
            else:
                runner.last_event = now
                runner.first_event = runner.first_event or now
            runner.interval = runner.base
            runner.wake.set()

    def publish(self, obs: Observation) -> None:
        failed = f"failed: {obs.error}" if obs.error else None
        with self._said_lock:
            self._said.say(obs.source, failed, logging.ERROR, back="recovered")
        for subscriber in self._subscribers:
            try:
                subscriber(obs)
            except Exception:  # a bug in one subscriber must not end a source's thread
                log.exception("handling %s's observation failed", obs.source)

    def _watch_timeouts(self) -> None:
        while not self.stopping.wait(WATCHDOG_SECONDS):
            now = time.monotonic()
            for runner in self.runners.values():
                since = runner.running_since
                if since is None or runner.timed_out or now - since <= runner.timeout:
                    continue
                runner.timed_out = True  # left to finish (or not), never started twice
                error = f"timed out after {runner.timeout:g}s"
                self.publish(Observation(runner.source.name, None, error, now - since))
