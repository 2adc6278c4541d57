"""When the next scrape is due, learned from the scrapes seen so far.

A DaemonSet's model changes every poll (a pod's memory usage moves by a page), but
Prometheus reads it every 15 to 60 s: rendering every change (65 ms at 200 pods) would
spend most of the exporter's CPU on bytes nobody reads. Prometheus scrapes each target
on a fixed ticker, so the next scrape of each scraper (an HA pair is two) is predictable
from its last ones; the render thread renders a non-urgent change just before the
earliest one is due, and right away when nothing can be predicted.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional

# Intervals remembered per scraper: the median of these is its interval.
INTERVALS_KEPT = 5
# A scraper counts once it has shown this many intervals that agree within TOLERANCE.
INTERVALS_NEEDED = 2
TOLERANCE = 0.25
# Scrapers come and go (a Prometheus restarts, an operator curls once): one not seen for
# this many of its intervals no longer sets the schedule.
FORGET_AFTER_INTERVALS = 3.0
# A scraper's due time projected from its last scrape and from the one before agree within
# this (Prometheus's ticker jitters by milliseconds).
JITTER_SECONDS = 0.2
# Shorter intervals than this are a human or a benchmark hammering: render every change.
MIN_INTERVAL = 0.5


class _Scraper:
    __slots__ = ("last", "intervals")

    def __init__(self, now: float):
        self.last = now
        self.intervals: Deque[float] = deque(maxlen=INTERVALS_KEPT)

    def interval(self) -> Optional[float]:
        """The scraper's steady interval; None until it has shown one."""
        if len(self.intervals) < INTERVALS_NEEDED:
            return None
        median = statistics.median(self.intervals)
        recent = list(self.intervals)[-INTERVALS_NEEDED:]
        if median < MIN_INTERVAL or any(
            abs(i - median) > TOLERANCE * median for i in recent
        ):
            return None
        return median


class ScrapeClock:
    """Scrape times by scraper (address and user agent); thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._scrapers: Dict[str, _Scraper] = {}
        self._on_unknown: List[Callable[[], None]] = []

    def on_unknown(self, listener: Callable[[], None]) -> None:
        """Called when a scrape ends the schedule (a scraper shows it is irregular or
        hammering): what waits for a scrape (held renders, held event-driven runs) looks
        again at once instead of at its next slice, up to a second later."""
        self._on_unknown.append(listener)

    def scraped(self, who: str) -> None:
        now = self.clock()
        with self._lock:
            known = self._due(now) is not None
            scraper = self._scrapers.get(who)
            if scraper is None:
                if (
                    len(self._scrapers) >= 64
                ):  # a scan of the port must not grow this without end
                    self._forget(now, everyone_irregular=True)
                self._scrapers[who] = _Scraper(now)
                return
            scraper.intervals.append(now - scraper.last)
            scraper.last = now
            ended = known and self._due(now) is None
        if ended:
            for listener in self._on_unknown:
                listener()

    def next_due(self, after: float = 0.0) -> Optional[float]:
        """When (on `clock`) the earliest scrape due later than `after` is (the render thread
        passes the one it last rendered for); None when some scraper's is not known (none
        seen yet, or one irregular): then every change is rendered at once."""
        now = self.clock()
        with self._lock:
            return self._due(now, after)

    def _due(self, now: float, after: float = 0.0) -> Optional[float]:
        self._forget(now)
        if not self._scrapers:
            return None
        due = []
        for scraper in self._scrapers.values():
            if not scraper.intervals:
                continue  # one scrape so far (a curl, a probe): it sets no schedule yet
            interval = scraper.interval()
            if interval is None:
                return None
            when = scraper.last + interval
            # Rendered for already (give or take a scrape's jitter: `after` was projected
            # from an earlier scrape): the one after it (the scrape itself may be late).
            # Not a fraction of the interval: an HA pair's second replica scrapes seconds
            # after the first, and needs a render of its own.
            if when <= after + JITTER_SECONDS:
                when += max(1, int((after - when) // interval) + 1) * interval
            due.append(when)
        return min(due) if due else None

    def _forget(self, now: float, everyone_irregular: bool = False) -> None:
        for who, scraper in list(self._scrapers.items()):
            interval = scraper.interval()
            if interval is None:
                # Irregular, hammering or new: forgotten after ten of its typical gaps of
                # silence, between 5 s and a minute (or at once when the table is full).
                typical = (
                    statistics.median(scraper.intervals) if scraper.intervals else 6.0
                )
                if everyone_irregular or now - scraper.last > min(
                    60.0, max(5.0, 10 * typical)
                ):
                    del self._scrapers[who]
            elif now - scraper.last > FORGET_AFTER_INTERVALS * interval:
                del self._scrapers[who]
