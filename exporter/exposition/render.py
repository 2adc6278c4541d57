"""/metrics bytes, rendered once per model update and served as they are.

The model step says when it changed (an observation, a state change); a render thread
waits for that, lets a burst settle for RENDER_COALESCE_SECONDS, rebuilds the
model and renders it once: the bodies scrapes asked for lately (bodies.py: the text format
0.0.4, OpenMetrics, what Prometheus asks for first, negotiated as prometheus_client does,
both joined from one set of sample lines, and their gzip). A scrape only picks the bytes:
rendering 4,000 node-mode samples per scrape cost 90 ms (prometheus_client's OpenMetrics
encoder 79 ms for 5,000), while a DaemonSet's model changes once per poll.
A body nobody asked for yet is made by the first scrape that wants it (once per render).

A scrape that arrives before the first render renders in its own thread (nothing cached
yet); a `name[]`-filtered scrape encodes the chosen families of the last render.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from typing import Optional
from urllib.parse import parse_qs

from prometheus_client.exposition import (
    CONTENT_TYPE_PLAIN_0_0_4,
    choose_encoder,
    gzip_accepted,
    generate_latest,
)
from prometheus_client.registry import CollectorRegistry

from exporter.exposition.bodies import GZIP_LEVEL, Render, WantedBodies
from exporter.runtime.duty_cycle import DutyCycle
from exporter.exposition.gzip_blocks import GzipBlocks
from exporter.exposition.scrape_clock import ScrapeClock

log = logging.getLogger(__name__)

# A burst of inotify events, or one poll's sources finishing one after another, costs one
# render per this much time at most; it is also the least a change waits to be visible.
RENDER_COALESCE_SECONDS = 0.1
# What an event-driven run found (a new segment) waits only this long: detection latency.
URGENT_COALESCE_SECONDS = 0.02
# A render costs its CPU time again in idle time at least this many times over (less what
# it had to spare before: duty_cycle.py), so a storm of changes on a big node costs a
# bounded share of a core (at most 1/(1+factor)).
RENDER_DUTY_FACTOR = 4.0
# A change waiting for the next scrape is rendered this long before it is due
# at least (more when renders take longer: RENDER_LEAD_FACTOR times the last one's time).
RENDER_LEAD_SECONDS = 0.3
RENDER_LEAD_FACTOR = 3.0
# A scrape that finds bytes older than this behind a change (it came early: a new scraper,
# a changed interval) renders them afresh rather than serve data that old.
STALE_AFTER_SECONDS = 2.0
# Changes after the render for a coming scrape are rendered again this long before it.
CATCH_UP_SECONDS = 0.1
# A held render looks at the schedule again this often (a scraper that turns up meanwhile
# finds bytes at most STALE_AFTER_SECONDS behind in any case).
HOLD_SLICE_SECONDS = 1.0


class Exposition:
    """Renders `registry` when `changed()` is called (coalesced), serves the bytes via `wsgi_app`."""

    def __init__(
        self, registry: CollectorRegistry, coalesce: float = RENDER_COALESCE_SECONDS
    ):
        self.registry = registry
        self.coalesce = coalesce
        self._wake = threading.Event()
        self._urgent = threading.Event()
        self._stopping = threading.Event()
        self._current: Optional[Render] = None
        self._version = 0  # bumped by every changed()
        self._render_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.renders = 0
        self.clock = ScrapeClock()  # when the next scrape is due: changes wait for it
        # A wait for a scrape ends early when a scrape ends the schedule (a scraper that
        # turned up hammering: rendered at once, not at the next slice), or when stopping.
        self._look_again = threading.Event()
        self.clock.on_unknown(self._look_again.set)
        self._render_seconds = 0.0  # wall time of the last render
        self._rendered_for = (
            0.0  # the due time of the scrape the last held render was for
        )
        self._wanted = (
            WantedBodies()
        )  # the bodies each render makes: those scrapes asked for lately
        self._blocks = GzipBlocks(
            GZIP_LEVEL
        )  # compressed blocks, reused while unchanged

    def changed(self, urgent: bool = False) -> None:
        """The model changed: render soon (sooner when urgent). Cheap; called from any thread."""
        self._version += 1
        if urgent:
            self._urgent.set()
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="shmwatch-render", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._look_again.set()
        if self._thread is not None:
            self._thread.join(1.0)

    def _run(self) -> None:
        duty = DutyCycle(RENDER_DUTY_FACTOR)
        while not self._stopping.is_set():
            self._wake.wait()
            if self._stopping.is_set():
                return
            # Let the burst land (briefly when urgent); after a slow render, keep to the duty factor.
            woken = time.monotonic()
            while not self._stopping.is_set():
                urgent = self._urgent.is_set()
                coalesce = (
                    min(self.coalesce, URGENT_COALESCE_SECONDS)
                    if urgent
                    else self.coalesce
                )
                left = max(woken + coalesce, duty.not_before) - time.monotonic()
                if left <= 0:
                    break
                if urgent:
                    self._stopping.wait(left)
                else:
                    self._urgent.wait(left)  # an urgent change cuts the wait short
            self._wait_for_the_next_scrape()
            self._wake.clear()  # a change after this point wakes us again
            self._urgent.clear()
            began, started = (
                time.monotonic(),
                time.thread_time(),
            )  # CPU, not wall time: waiting for the GIL costs nothing
            try:
                self.render()
            except (
                Exception
            ):  # a broken render must not end the thread: the next one may work
                log.exception("rendering /metrics failed")
                # Never serve the last good bytes as if they were current: the next scrape
                # renders itself, and fails visibly (a 500, up=0) if the render still does.
                self._current = None
            duty.ran(began, time.thread_time() - started)

    def _wait_for_the_next_scrape(self) -> None:
        """Hold a change until just before the next scrape is due: the model of a big node
        changes every poll, and only what a scrape reads is worth rendering. An urgent change
        (a new segment) waits too: rendered sooner, nobody would see it sooner."""
        self._look_again.clear()
        if (
            self._stopping.is_set()
        ):  # stop() set _stopping before _look_again: no wait is lost
            return
        left = self._rendered_for - time.monotonic()
        if left > 0:
            # Before the scrape the last render was for: what changed since (a scrape-aligned
            # source finishing late) is rendered once more just before it, all together.
            catch_up = max(CATCH_UP_SECONDS, 1.5 * self._render_seconds)
            if left > catch_up and self.clock.next_due() is not None:
                self._look_again.wait(left - catch_up)
            return
        while not self._stopping.is_set():
            due = self.clock.next_due(after=self._rendered_for)
            if due is None:
                self._rendered_for = 0.0
                return  # no steady scraper known (or one hammering): render every change
            lead = max(RENDER_LEAD_SECONDS, RENDER_LEAD_FACTOR * self._render_seconds)
            left = due - lead - time.monotonic()
            if left <= 0:
                self._rendered_for = (
                    due  # changes from here on wait for the scrape after it
                )
                return
            # In slices: a scraper that turns up meanwhile (a human, a benchmark) may move
            # the schedule, or end it.
            self._look_again.wait(min(left, HOLD_SLICE_SECONDS))
            self._look_again.clear()

    def render(self) -> Render:
        with self._render_lock:
            started = time.monotonic()
            version = self._version
            done = Render(version, list(self.registry.collect()), self._blocks)
            self._blocks.next_render()
            # Every body a scraper has asked for lately is made here, before the render is served:
            # the text format until someone asks for anything; OpenMetrics (what Prometheus
            # asks for; 0.3 ms for 5,000 samples, joined from the same sample lines) and gzip
            # once someone asked. Gzip costs 5 ms per 5,000 samples and render (renders follow
            # the scrapes: see scrape_clock.py), but left to the first scrape of each render,
            # Prometheus's scrapes (each meets a new render) took 20 ms at p50 instead of 2 ms
            # (200 pods, bench/node_scale.py). A body nobody asked for is made by the scrape
            # that first does (a human's curl beside Prometheus).
            wanted = self._wanted.current() or [
                ((CONTENT_TYPE_PLAIN_0_0_4, False), generate_latest)
            ]
            for (content_type, gzipped), encoder in wanted:
                done.body(encoder, content_type, gzipped)
            self._current = done
            self.renders += 1
            self._render_seconds = time.monotonic() - started
            return done

    def latest(self) -> Render:
        current = self._current
        if current is not None and not self._stale(current):
            return current
        with self._render_lock:  # concurrent scrapes that find it stale render it once
            current = self._current
            if current is not None and not self._stale(current):
                return current
        return self.render()

    def _stale(self, current: Render) -> bool:
        """Behind a change and older than STALE_AFTER_SECONDS: a scrape that came early for
        the schedule (another scraper, a changed interval) renders afresh."""
        return (
            current.version != self._version
            and time.monotonic() - current.made > STALE_AFTER_SECONDS
        )

    # --- HTTP ---------------------------------------------------------------------------
    def wsgi_app(self, environ, start_response):
        method = environ.get("REQUEST_METHOD", "GET")
        if method == "OPTIONS":
            start_response("200 OK", [("Allow", "OPTIONS,GET")])
            return [b""]
        if method != "GET":
            start_response("405 Method Not Allowed", [("Allow", "OPTIONS,GET")])
            return [
                f"# HTTP 405 Method Not Allowed: {method}; use OPTIONS or GET\n".encode()
            ]
        scraper = (
            f"{environ.get('REMOTE_ADDR', '')} {environ.get('HTTP_USER_AGENT', '')}"
        )
        self.clock.scraped(scraper)
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT"))
        gzipped = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING"))
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        if names:
            # Filtered from the last render (the registry cannot restrict: it has no describe()).
            wanted = set(names)
            chosen = [
                m
                for m in self.latest().frozen.collect()
                if m.name in wanted or any(s.name in wanted for s in m.samples)
            ]
            body = Render(0, chosen).encode(encoder)
            body = gzip.compress(body, GZIP_LEVEL) if gzipped else body
        else:
            # The first scrape to want a body makes it from the render's sample lines (once
            # for this render); later renders make it before they are served.
            self._wanted.asked((content_type, gzipped), encoder, scraper)
            body = self.latest().body(encoder, content_type, gzipped)
        headers = [("Content-Type", content_type)]
        if gzipped:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]


def wait_rendered(exposition: Exposition, timeout: float = 5.0) -> bool:
    """Tests: wait until the latest change has been rendered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = exposition._current
        if current is not None and current.version == exposition._version:
            return True
        time.sleep(0.01)
    return False
