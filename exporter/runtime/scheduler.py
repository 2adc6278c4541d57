"""The scheduler: runs each source on its own thread and publishes what each run observed.

One thread per source, so a slow or hung source (a GPU fallen off the bus, a stuck
mount) never delays the others. A run that overruns its timeout is published as failed
the moment it overruns (a watchdog thread), and its thread is not replaced while it is
still stuck. Sources scheduled "poll" run every --poll-interval, "inventory" every
--inventory-interval; sources marked `event_driven` also run early, debounced, when the
watcher says a mount changed (collect_quick when they have it).

The sampler keeps no results: subscribers (the model step, the watcher) get each
Observation as it is made.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from exporter.model.types import Observation
from exporter.runtime.duty_cycle import DutyCycle

log = logging.getLogger(__name__)

# How long an event-driven run waits for an inotify burst to settle, and how far it may
# be pushed back by a burst that never settles.
DEBOUNCE_SECONDS = 0.02
DEBOUNCE_MAX_SECONDS = 0.1
# An event-driven run costs its CPU time again in idle time at least this many times
# over (less what it had to spare before: duty_cycle.py), so a storm of creates costs a
# bounded share of a core.
QUICK_SCAN_DUTY_FACTOR = 4.0
# How often the watchdog looks for runs over their timeout (timeouts are seconds long).
WATCHDOG_SECONDS = 0.5
# After a burst, a full run (owners from /proc) follows this soon.
FOLLOW_UP_SECONDS = 1.0
# With a steady scraper, an event-driven run waits until this long (or four of its own
# durations, if more) before the next scrape is due: what it finds is read by nobody
# sooner, and a node's creates then cost one run per scrape, not one per burst.
QUICK_LEAD_SECONDS = 1.0
# Events held for a scrape are left to the full run due before it only when that run ends
# (at twice its last duration) this long before the scrape at least: the render after it
# (coalesced for 0.1 s, then rendered; exposition.py) must be done by then, or the events
# miss the scrape they were held for and wait for the next one.
FULL_RUN_MARGIN_SECONDS = 0.4
# Two due times this close are the same scrape (scrape_clock.py: Prometheus's ticker
# jitters by milliseconds; a steady scraper's intervals are 0.5 s or more).
SAME_SCRAPE_SECONDS = 0.2
# A held run, or a scrape-aligned source waiting, looks at the schedule again this often
# (each look costs a little: five sources at 4 Hz were a tenth of a sidecar's idle CPU).
HOLD_SLICE_SECONDS = 1.0
# A scrape-aligned source (`scrape_aligned`: host memory, the process's own figures, SysV,
# cgroups while the kernel log counts the OOM kills, the inventory while inotify watches
# every mount) runs this long (or four of its durations, if more) before a scrape is due.
SCRAPE_LEAD_SECONDS = 1.0


class _Runner(threading.Thread):
    def __init__(self, sampler: "Sampler", source, interval: float, timeout: float):
        super().__init__(name=f"shmwatch-{source.name}", daemon=True)
        self.sampler = sampler
        self.source = source
        self.interval = interval
        self.timeout = timeout
        self.wake = threading.Event()
        self.look_again = (
            threading.Event()
        )  # a held run: the schedule ended, or stopping
        self.quick_pending = False
        self.first_event_at: Optional[float] = None
        self.follow_up_at: Optional[float] = None
        self.duty = DutyCycle(
            QUICK_SCAN_DUTY_FACTOR
        )  # quick and interim runs: a bounded share of a core
        self.early_duty = DutyCycle(
            QUICK_SCAN_DUTY_FACTOR
        )  # early publishes: their own share
        self.early_shown = False  # an early publish showed every event so far
        self.quick_wall = (
            0.0  # the last event-driven run's wall time (its CPU time spaces the runs)
        )
        self.full_spent = 0.0  # the last full run's
        self.running_since: Optional[float] = None
        self.timed_out = False
        self.runs = 0
        self.last_ok: Optional[bool] = None  # the last run's outcome
        self.last_result: object = None
        self._last_full: Optional[Tuple[float, float]] = (
            None  # (planned at, ran at) of the last full run
        )
        self.full_now = False
        # The scrape the last quick run was made for (started in its lead): events after it wait
        # for the next scrape's, so a scrape costs its full run and one quick run at most.
        self.ran_for: Optional[float] = None
        if hasattr(source, "collect_interim"):
            source.interim_hook = self._interim

    def request_full(self) -> None:
        self.full_now = True
        self.wake.set()

    def request_quick(self) -> None:
        if self.first_event_at is None:
            self.first_event_at = time.monotonic()
        self.quick_pending = True
        self.early_shown = False
        self.wake.set()

    def run(self) -> None:
        stop = self.sampler.stopping
        next_full = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if self.full_now:
                self.full_now = False
                next_full = now
            if now >= next_full:
                self._last_full = (next_full, now)
                # A full run does all a pending event-driven run would (it drains the same
                # change log): the events so far are its own. One landing from here on asks
                # for a quick run again.
                self.quick_pending = False
                self.first_event_at = None
                self.run_once(full=True)
                self.full_spent = time.monotonic() - now
                next_full = self._next_full_after(*self._last_full)
                self.follow_up_at = None
                if getattr(self.source, "changes_pending", lambda: False)():
                    # Names its interim runs published, given back for their owners, or names
                    # they could not patch: a quick run, as for events during any full run.
                    self.request_quick()
                continue
            if (
                self.quick_pending
                and self.follow_up_at is not None
                and now >= self.follow_up_at
            ):
                next_full = now  # the follow-up of an earlier quick run: a full run takes these events too
                continue
            if self.quick_pending:
                # Debounce: run once the burst has been quiet for DEBOUNCE_SECONDS, or
                # DEBOUNCE_MAX_SECONDS after its first event, whichever comes first.
                first = self.first_event_at or now
                while not stop.is_set():
                    self.wake.clear()
                    left = first + DEBOUNCE_MAX_SECONDS - time.monotonic()
                    if left <= 0 or not self.wake.wait(min(DEBOUNCE_SECONDS, left)):
                        break
                self._early()
                while not stop.is_set() and self.duty.wait_left() > 0:
                    self.wake.clear()  # held by the duty cycle: later bursts are published early
                    if self.wake.wait(self.duty.wait_left()) and not stop.wait(
                        DEBOUNCE_SECONDS
                    ):
                        self._early()
                if (
                    stop.is_set()
                ):  # not a run the duty cycle held back, now that nothing reads it
                    break
                due = self.sampler.scrape_due()
                if (
                    due is not None
                    and self.ran_for is not None
                    and abs(due - self.ran_for) < SAME_SCRAPE_SECONDS
                ):
                    # This scrape had its quick run: these events wait for the next scrape's. Under
                    # churn, a quick run for each burst in the last second before every scrape (after
                    # the full run made for it) cost 2.5 runs a scrape.
                    due = self.sampler.scrape_due(after=due) or due
                if due is not None:
                    hold = due - max(
                        QUICK_LEAD_SECONDS, QUICK_SCAN_DUTY_FACTOR * self.quick_wall
                    )
                    if next_full + 2 * self.full_spent + FULL_RUN_MARGIN_SECONDS < due:
                        # A full run done well before the scrape (a scrape-aligned source's, made
                        # for it) takes these events: one run, not a quick run and a full run back
                        # to back (a node's 150 changed pods read twice per scrape).
                        hold = max(hold, next_full)
                    if hold > time.monotonic():
                        # Held for the scrape (a full run due before then runs first; more
                        # events only add names to the same run), in slices: a scraper that
                        # turns up meanwhile may move the schedule, or end it.
                        wake_at = min(
                            hold,
                            next_full,
                            self.follow_up_at or hold,
                            time.monotonic() + HOLD_SLICE_SECONDS,
                        )
                        self.look_again.wait(wake_at - time.monotonic())
                        self.look_again.clear()
                        self.first_event_at = self.first_event_at or time.monotonic()
                        continue
                # This order loses no event: one that lands in between leaves
                # quick_pending set (first_event_at None is handled above).
                self.quick_pending = False
                self.first_event_at = None
                self.ran_for = self._serving(
                    max(QUICK_LEAD_SECONDS, QUICK_SCAN_DUTY_FACTOR * self.quick_wall)
                )
                started, cpu = time.monotonic(), time.thread_time()
                self.run_once(full=False, settling=self.early_shown)
                self.quick_wall = (
                    time.monotonic() - started
                )  # wall time: the lead a held run needs
                # The duty factor bounds the share of a core, so it counts CPU time: waiting for
                # the GIL or the disk made a node's 15 ms runs 40 ms, and the next event wait 160 ms.
                self.duty.ran(started, time.thread_time() - cpu)
                # A source that settled the run itself (node mode's pod-scoped owner scan)
                # needs no full follow-up; the others get one.
                if getattr(self.source, "wants_follow_up", True):
                    self.follow_up_at = time.monotonic() + FOLLOW_UP_SECONDS
                continue
            if self.follow_up_at is not None and now >= self.follow_up_at:
                next_full = now
                continue
            deadline = min(next_full, self.follow_up_at or next_full)
            may_align = bool(
                getattr(self.source, "scrape_aligned", False)
            )  # True, or a callable
            if may_align:
                deadline = min(
                    deadline, now + HOLD_SLICE_SECONDS
                )  # the schedule may change
            self.wake.wait(max(0.0, deadline - now))
            self.wake.clear()
            if may_align and self._last_full is not None:
                # A scraper that turned up hammering, the last steady one gone, or the OOM log
                # failing (cgroups) ends the wait for a scrape: back to the interval.
                next_full = min(next_full, self._next_full_after(*self._last_full))

    def _interim(self) -> None:
        """Called by a full run between its reads of /proc: publish the events so far (the
        listings patched, collect_interim) rather than hold them for the whole read, with no
        steady scraper (one reads the full run made for it) and within the duty factor."""
        if not self.quick_pending:
            return
        now = time.monotonic()
        if (
            now < self.duty.not_before
            or now - (self.first_event_at or now) < DEBOUNCE_SECONDS
            or self.sampler.scrape_due() is not None
        ):
            return
        self.quick_pending, self.first_event_at = False, None
        cpu = time.thread_time()
        self._publish_patched("interim run", self.source.collect_interim)
        self.duty.ran(now, time.thread_time() - cpu)

    def _early(self) -> None:
        """Before a quick run that reads the changed pods (node mode): the names inotify reported,
        with the last owners, published while it reads them. No steady scraper; its own duty cycle."""
        if (
            not getattr(self.source, "pod_of_pid", False)
            or self.sampler.scrape_due() is not None
            or time.monotonic() < self.early_duty.not_before
        ):
            return
        started, cpu = time.monotonic(), time.thread_time()
        self.early_shown = True  # before the drain: an event during it says otherwise
        result = self._publish_patched(
            "early publish", lambda: self.source.collect_interim(early=True)
        )
        if (
            result is None or getattr(self.source, "changes_pending", lambda: False)()
        ):  # names given back
            self.early_shown = False  # nobody saw those; only set False: a request_quick meanwhile stands
        self.early_duty.ran(started, time.thread_time() - cpu)

    def _publish_patched(self, what: str, collect: Callable[[], object]) -> object:
        """collect_interim's patched listings, published as an event-driven run's; None when nothing
        could be patched, or it failed (logged; the full or quick run after it goes on regardless)."""
        started = time.monotonic()
        try:
            result = collect()
        except Exception:
            log.exception("%s: %s failed", self.source.name, what)
            return None
        if result is not None:
            self.sampler.publish(
                Observation(
                    self.source.name,
                    result,
                    None,
                    time.monotonic() - started,
                    full=False,
                )
            )
        return result

    def _serving(self, lead: float) -> Optional[float]:
        """The scrape a quick run starting now is made for: the next one, when it is due within
        the run's lead (and a little more); None otherwise (no steady scraper)."""
        due = self.sampler.scrape_due()
        # An overdue scrape (late, or dropped) is served by no run yet: events keep running at once.
        return (
            due
            if due is not None
            and 0 < due - time.monotonic() <= lead + SAME_SCRAPE_SECONDS
            else None
        )

    def _aligned(self) -> bool:
        aligned = getattr(self.source, "scrape_aligned", False)
        return bool(aligned() if callable(aligned) else aligned)

    def _next_full_after(self, planned_at: float, ran_at: float) -> float:
        """The interval on; for a source whose figures matter only when scraped (no peaks kept
        from it between scrapes), once per scrape instead, just before it is due. Reckoned
        from the last run, so asking again while waiting gives the same answer."""
        planned = max(planned_at + self.interval, ran_at)
        if not self._aligned():
            return planned
        # The first scrape due after the one the last run was for; started early enough that
        # it is done, and rendered, before the scrape (a node's full inventory takes 0.5 s).
        lead = max(SCRAPE_LEAD_SECONDS, QUICK_SCAN_DUTY_FACTOR * self.full_spent)
        due = self.sampler.scrape_due(ran_at + lead)
        return planned if due is None else max(planned, due - lead)

    def run_once(self, full: bool, settling: bool = False) -> None:
        started = time.monotonic()
        self.running_since, self.timed_out = started, False
        try:
            if full or not hasattr(self.source, "collect_quick"):
                result = self.source.collect()
            else:
                result = self.source.collect_quick()
            error = None
        except Exception as err:  # one source failing must not stop the others
            result, error = None, f"{type(err).__name__}: {err}"
        self.running_since = None
        self.runs += 1
        self.last_ok = error is None
        self.last_result = result
        self.sampler.publish(
            Observation(
                self.source.name,
                result,
                error,
                time.monotonic() - started,
                full,
                settling=settling and error is None,
            )
        )


class Sampler:
    def __init__(
        self,
        sources: Sequence,
        poll_interval: float = 1.0,
        inventory_interval: float = 15.0,
        timeouts: Optional[Dict[str, float]] = None,
        default_timeout: float = 10.0,
    ):
        self.stopping = threading.Event()
        # When the next scrape (after a time, if given) is due: the exposition's scrape
        # clock. None: not known, and every source keeps to its interval.
        self.scrape_due: Callable[..., Optional[float]] = lambda after=0.0: None
        self._subscribers: List[Callable[[Observation], None]] = []
        self._logged_errors: Dict[str, Optional[str]] = {}
        self._log_lock = threading.Lock()
        timeouts = timeouts or {}
        self.runners: Dict[str, _Runner] = {}
        for source in sources:
            interval = (
                inventory_interval if source.schedule == "inventory" else poll_interval
            )
            self.runners[source.name] = _Runner(
                self, source, interval, timeouts.get(source.name, default_timeout)
            )
        self._watchdog = threading.Thread(
            target=self._watch_timeouts, name="shmwatch-watchdog", daemon=True
        )

    @property
    def sources(self) -> List[object]:
        return [r.source for r in self.runners.values()]

    def subscribe(self, subscriber: Callable[[Observation], None]) -> None:
        self._subscribers.append(subscriber)

    # --- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        for runner in self.runners.values():
            runner.start()
        self._watchdog.start()

    def stop(self, timeout: float = 1.0) -> None:
        self.stopping.set()
        for runner in self.runners.values():
            runner.wake.set()
            runner.look_again.set()
        deadline = time.monotonic() + timeout
        for runner in self.runners.values():
            if runner.is_alive():
                runner.join(max(0.0, deadline - time.monotonic()))

    def run_once(self) -> None:
        """Run every source once, in this thread (tests)."""
        for runner in self.runners.values():
            runner.run_once(full=True)

    def wait_for_first_run(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(r.runs or r.timed_out for r in self.runners.values()):
                return True
            time.sleep(0.01)
        return False

    def stuck(self) -> List[str]:
        """Sources whose current run has overrun its timeout."""
        return [
            name
            for name, r in self.runners.items()
            if r.running_since is not None and r.timed_out
        ]

    def request_full(self) -> None:
        """Events were lost (inotify queue overflow): event-driven sources run a full run now."""
        for runner in self.runners.values():
            if getattr(runner.source, "event_driven", False):
                runner.request_full()

    def schedule_ended(self) -> None:
        """A scrape ended the schedule (scrape_clock.ScrapeClock.on_unknown): runs held for a
        scrape, and sources waiting for one, look again now rather than at their next slice."""
        for runner in self.runners.values():
            runner.look_again.set()
            runner.wake.set()

    def request_quick(self) -> None:
        """A watched mount changed: event-driven sources run soon (debounced)."""
        for runner in self.runners.values():
            if getattr(runner.source, "event_driven", False):
                runner.request_quick()

    # --- results ------------------------------------------------------------------------
    def publish(self, obs: Observation) -> None:
        self._log_change(obs.source, obs.error)
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
                if (
                    since is not None
                    and not runner.timed_out
                    and now - since > runner.timeout
                ):
                    # Hung: the last result is stale, and this run has failed. The thread is
                    # left to finish (or not); it is never started twice.
                    runner.timed_out = True
                    self.publish(
                        Observation(
                            runner.source.name,
                            None,
                            f"timed out after {runner.timeout:g}s",
                            now - since,
                        )
                    )

    def _log_change(self, name: str, error: Optional[str]) -> None:
        # Log when a source starts failing or recovers, not on every tick.
        with self._log_lock:
            previous = self._logged_errors.get(name)
            if error == previous:
                return
            self._logged_errors[name] = error
        if error:
            log.error("collector %s failed: %s", name, error)
        elif previous:
            log.info("collector %s recovered", name)
