"""/metrics bytes, rendered once per model update and served as they are.

The model step says when it changed (an observation, a state change); a render thread
waits for that, lets a burst settle for RENDER_COALESCE_SECONDS, rebuilds the
model and renders it once: the text format (0.0.4) and, once a scraper has asked for
them, OpenMetrics (what Prometheus asks for first; negotiated as prometheus_client does),
both joined from one set of sample lines, and their gzip. A scrape only picks the bytes:
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
from typing import Callable, Dict, List, Optional, Tuple
from urllib.parse import parse_qs

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, gzip_accepted, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import CollectorRegistry

from .duty_cycle import DutyCycle
from .gzip_blocks import GzipBlocks, blocks_of
from .sample_lines import LEGACY_NAME, sample_line
from .scrape_clock import ScrapeClock

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
# Level 1 compresses a node's 1.8 MB exposition 9x (level 6: 11x) in half level 6's time
# (9 against 19 ms, bench/node_scale.py's 200 pods): a DaemonSet's CPU is worth more than a
# fifth more bytes once per scrape.
GZIP_LEVEL = 1


def _sample_chunks(metrics: List[object], blocks: Optional[GzipBlocks] = None) -> Optional[List[List[str]]]:
    """Each family's sample lines, joined into blocks (gzip_blocks.blocks_of): the same in
    the text format 0.0.4 and in OpenMetrics 1.0.0 for gauges and counters without timestamps, exemplars or units with
    legacy names (all this exporter makes). None for anything else: the caller falls back
    to prometheus_client's encoders. Label names are checked and sorted once per family, not
    once per sample, and a value is escaped only when it holds something to escape."""
    chunks: List[List[str]] = []
    for metric in metrics:
        mtype = metric.type
        if mtype not in ("gauge", "counter") or metric.unit or not LEGACY_NAME.match(metric.name):
            return None
        lines = getattr(metric, "lines", None)  # formatted by families.Families as it went
        if lines is not None and len(lines) == len(metric.samples):
            chunks.append(blocks_of(lines) if blocks is None else blocks.blocks(metric.name, lines))
            continue
        # A sample of another name (a counter's _created) is placed apart by the text format.
        sname = metric.name + "_total" if mtype == "counter" else metric.name
        out: List[str] = []
        order: Optional[List[str]] = None
        for sample in metric.samples:
            if sample.timestamp is not None or sample.exemplar is not None or sample.name != sname:
                return None
            labels = sample.labels
            if order is None or len(order) != len(labels):
                order = sorted(labels)
                if not all(LEGACY_NAME.match(k) for k in order):
                    return None
            try:
                out.append(sample_line(sample, order))
            except KeyError:  # another set of label names in the same family
                return None
        chunks.append(["".join(out)])
    return chunks


def _text_pieces(metrics: List[object], chunks: List[List[str]]) -> List[str]:
    """The text format 0.0.4, in pieces: each family's HELP and TYPE, then its blocks."""
    out: List[str] = []
    for metric, blocks in zip(metrics, chunks):
        mname = metric.name + "_total" if metric.type == "counter" else metric.name
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {mname} {doc}\n# TYPE {mname} {metric.type}\n")
        out.extend(blocks)  # apart from the header: the same objects as the last render's (GzipBlocks.blocks)
    return out


def _openmetrics_pieces(metrics: List[object], chunks: List[List[str]]) -> List[str]:
    # OpenMetrics names a counter's family without _total, and escapes '"' in HELP too.
    out: List[str] = []
    for metric, blocks in zip(metrics, chunks):
        name = metric.name
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
        out.extend(blocks)
    out.append("# EOF\n")
    return out


def text_format(metrics: List[object]) -> bytes:
    """The text format 0.0.4, byte for byte what prometheus_client's generate_latest writes,
    at a fraction of its cost (see _sample_chunks)."""
    chunks = _sample_chunks(metrics)
    return generate_latest(_Frozen(metrics)) if chunks is None else "".join(_text_pieces(metrics, chunks)).encode()


def openmetrics_format(metrics: List[object]) -> bytes:
    """OpenMetrics 1.0.0, byte for byte what prometheus_client.openmetrics's generate_latest
    writes (escaping underscores or allow-utf-8: the same for legacy names)."""
    chunks = _sample_chunks(metrics)
    if chunks is None:
        return openmetrics.generate_latest(_Frozen(metrics))
    return "".join(_openmetrics_pieces(metrics, chunks)).encode()


def _fast_kind(encoder: Callable) -> Optional[str]:
    """Which of our formatters makes what `encoder` (from choose_encoder) would: "text",
    "openmetrics", or None (anything else, e.g. escaping=dots or values, which rewrite
    names; a later OpenMetrics version): that is left to the encoder itself."""
    func, keywords = getattr(encoder, "func", encoder), getattr(encoder, "keywords", {}) or {}
    if keywords.get("escaping", openmetrics.UNDERSCORES) not in (openmetrics.UNDERSCORES, openmetrics.ALLOWUTF8):
        return None
    if func is generate_latest:
        return "text"
    if func is openmetrics.generate_latest and keywords.get("version", "1.0.0") == "1.0.0":
        return "openmetrics"
    return None


class _Frozen:
    """The families of one render, for the encoders that take something with collect()."""

    def __init__(self, metrics: List[object]):
        self._metrics = metrics

    def collect(self):
        return iter(self._metrics)


class _Render:
    """One render's families and the bodies made from them, by (content type, gzip): each
    made at most once per render, from the sample lines collected once. Gzip reuses the
    blocks of the last render that did not change (`blocks`)."""

    def __init__(self, version: int, metrics: List[object], blocks: Optional[GzipBlocks] = None):
        self.version = version
        self.made = time.monotonic()
        self.frozen = _Frozen(metrics)
        self.chunks = _sample_chunks(metrics, blocks)
        self.blocks = blocks
        self.bodies: Dict[Tuple[str, bool], bytes] = {}
        self.built = 0  # bodies made (a test asserts scrapes make none)
        self.lock = threading.Lock()

    def pieces(self, encoder: Callable) -> Optional[List[str]]:
        """The body `encoder` would write, in pieces (each family's blocks), when our own
        formatters make it; None when prometheus_client's encoder must."""
        kind = _fast_kind(encoder) if self.chunks is not None else None
        if kind is None:
            return None
        return (_text_pieces if kind == "text" else _openmetrics_pieces)(self.frozen._metrics, self.chunks)

    def encode(self, encoder: Callable, pieces: Optional[List[str]] = None) -> bytes:
        """The body `encoder` would write; `pieces` when already asked for."""
        pieces = self.pieces(encoder) if pieces is None else pieces
        return encoder(self.frozen) if pieces is None else "".join(pieces).encode("utf-8")

    def body(self, encoder: Callable, content_type: str, gzipped: bool) -> bytes:
        key = (content_type, gzipped)
        with self.lock:
            cached = self.bodies.get(key)
            if cached is None:
                pieces = self.pieces(encoder)
                raw = self.bodies.get((content_type, False))
                if raw is None:
                    raw = self.bodies[(content_type, False)] = self.encode(encoder, pieces)
                    self.built += 1
                if not gzipped:
                    cached = raw
                elif self.blocks is not None and pieces is not None:
                    cached = self.blocks.gzip(pieces, raw)
                else:
                    cached = gzip.compress(raw, GZIP_LEVEL)
                self.bodies[key] = cached
                self.built += gzipped
            return cached


class Exposition:
    """Renders `registry` when `changed()` is called (coalesced), serves the bytes via `wsgi_app`."""

    def __init__(self, registry: CollectorRegistry, coalesce: float = RENDER_COALESCE_SECONDS):
        self.registry = registry
        self.coalesce = coalesce
        self._wake = threading.Event()
        self._urgent = threading.Event()
        self._stopping = threading.Event()
        self._current: Optional[_Render] = None
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
        self._rendered_for = 0.0  # the due time of the scrape the last held render was for
        # (content type, gzip) -> encoder, of every body a scrape asked for: made by each render.
        self._wanted: Dict[Tuple[str, bool], Callable] = {}
        self._blocks = GzipBlocks(GZIP_LEVEL)  # compressed blocks, reused while unchanged

    def changed(self, urgent: bool = False) -> None:
        """The model changed: render soon (sooner when urgent). Cheap; called from any thread."""
        self._version += 1
        if urgent:
            self._urgent.set()
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="shmwatch-render", daemon=True)
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
                coalesce = min(self.coalesce, URGENT_COALESCE_SECONDS) if urgent else self.coalesce
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
            began, started = time.monotonic(), time.thread_time()  # CPU, not wall time: waiting for the GIL costs nothing
            try:
                self.render()
            except Exception:  # a broken render must not end the thread: the next one may work
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
        if self._stopping.is_set():  # stop() set _stopping before _look_again: no wait is lost
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
                self._rendered_for = due  # changes from here on wait for the scrape after it
                return
            # In slices: a scraper that turns up meanwhile (a human, a benchmark) may move
            # the schedule, or end it.
            self._look_again.wait(min(left, HOLD_SLICE_SECONDS))
            self._look_again.clear()

    def render(self) -> _Render:
        with self._render_lock:
            started = time.monotonic()
            version = self._version
            done = _Render(version, list(self.registry.collect()), self._blocks)
            self._blocks.next_render()
            # Every body a scraper has asked for is made here, before the render is served:
            # the text format until someone asks for anything; OpenMetrics (what Prometheus
            # asks for; 0.3 ms for 5,000 samples, joined from the same sample lines) and gzip
            # once someone asked. Gzip costs 5 ms per 5,000 samples and render (renders follow
            # the scrapes: see scrape_clock.py), but left to the first scrape of each render,
            # Prometheus's scrapes (each meets a new render) took 20 ms at p50 instead of 2 ms
            # (200 pods, bench/node_scale.py). A body nobody asked for is made by the scrape
            # that first does (a human's curl beside Prometheus).
            wanted = list(self._wanted.items()) or [((CONTENT_TYPE_PLAIN_0_0_4, False), generate_latest)]
            for (content_type, gzipped), encoder in wanted:
                done.body(encoder, content_type, gzipped)
            self._current = done
            self.renders += 1
            self._render_seconds = time.monotonic() - started
            return done

    def latest(self) -> _Render:
        current = self._current
        if current is not None and not self._stale(current):
            return current
        with self._render_lock:  # concurrent scrapes that find it stale render it once
            current = self._current
            if current is not None and not self._stale(current):
                return current
        return self.render()

    def _stale(self, current: _Render) -> bool:
        """Behind a change and older than STALE_AFTER_SECONDS: a scrape that came early for
        the schedule (another scraper, a changed interval) renders afresh."""
        return current.version != self._version and time.monotonic() - current.made > STALE_AFTER_SECONDS

    # --- HTTP ---------------------------------------------------------------------------
    def wsgi_app(self, environ, start_response):
        method = environ.get("REQUEST_METHOD", "GET")
        if method == "OPTIONS":
            start_response("200 OK", [("Allow", "OPTIONS,GET")])
            return [b""]
        if method != "GET":
            start_response("405 Method Not Allowed", [("Allow", "OPTIONS,GET")])
            return [f"# HTTP 405 Method Not Allowed: {method}; use OPTIONS or GET\n".encode()]
        self.clock.scraped(f'{environ.get("REMOTE_ADDR", "")} {environ.get("HTTP_USER_AGENT", "")}')
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT"))
        gzipped = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING"))
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        if names:
            # Filtered from the last render (the registry cannot restrict: it has no describe()).
            wanted = set(names)
            chosen = [m for m in self.latest().frozen.collect()
                      if m.name in wanted or any(s.name in wanted for s in m.samples)]
            body = _Render(0, chosen).encode(encoder)
            body = gzip.compress(body, GZIP_LEVEL) if gzipped else body
        else:
            # The first scrape to want a body makes it from the render's sample lines (once
            # for this render); later renders make it before they are served. Only formats of
            # our own formatters are remembered: a bounded set (the content type carries the
            # Accept header's version, which a client could vary without end).
            if _fast_kind(encoder) is not None:
                self._wanted.setdefault((content_type, gzipped), encoder)
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
