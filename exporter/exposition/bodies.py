"""The bodies of one render, and which bodies renders make.

A render's families become the text format (0.0.4) and OpenMetrics 1.0.0, both joined from
one set of sample lines (formatted once per family, not once per sample, and byte for byte
what prometheus_client's encoders write), and their gzip, made from blocks compressed once
(gzip_blocks.py). Each body is made at most once per render. exposition.py decides when to
render; `WantedBodies` which bodies each render makes: those the scrapes asked for lately.
"""

from __future__ import annotations

import gzip
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from exporter.exposition.gzip_blocks import GzipBlocks, blocks_of
from exporter.exposition.sample_lines import LEGACY_NAME, sample_line

# Level 1 compresses a node's 1.8 MB exposition 9x (level 6: 11x) in half level 6's time
# (9 against 19 ms, bench/node_scale.py's 200 pods): a DaemonSet's CPU is worth more than a
# fifth more bytes once per scrape.
GZIP_LEVEL = 1
# A body no scrape asked for in this many of its intervals (and WANTED_FOR_SECONDS at least)
# is no longer made by every render: a human's one curl, or a scraper gone, made each later
# render pay for its body (a node's gzip'd text: 2.3 MB joined, hashed and compressed, a
# third of each render while a benchmark hammered for OpenMetrics). The next scrape that
# wants it makes it, as the first one did.
WANTED_GAPS = 3.0
WANTED_FOR_SECONDS = 30.0
# And this long at most: a human's two curls an hour apart are not a scraper whose body
# every render should make for three hours (three of the longest usual interval, 5 min).
WANTED_AT_MOST_SECONDS = 900.0
# Scrapers remembered per body (as scrape_clock.py's table): a scan of the port must not grow it.
MAX_SCRAPERS = 64


def _sample_chunks(
    metrics: List[object], blocks: Optional[GzipBlocks] = None
) -> Optional[List[List[str]]]:
    """Each family's sample lines, joined into blocks (gzip_blocks.blocks_of): the same in
    the text format 0.0.4 and in OpenMetrics 1.0.0 for gauges and counters without timestamps, exemplars or units with
    legacy names (all this exporter makes). None for anything else: the caller falls back
    to prometheus_client's encoders. Label names are checked and sorted once per family, not
    once per sample, and a value is escaped only when it holds something to escape."""
    chunks: List[List[str]] = []
    for metric in metrics:
        mtype = metric.type
        if (
            mtype not in ("gauge", "counter")
            or metric.unit
            or not LEGACY_NAME.match(metric.name)
        ):
            return None
        lines = getattr(
            metric, "lines", None
        )  # formatted by families.Families as it went
        if lines is not None and len(lines) == len(metric.samples):
            chunks.append(
                blocks_of(lines)
                if blocks is None
                else blocks.blocks(metric.name, lines)
            )
            continue
        # A sample of another name (a counter's _created) is placed apart by the text format.
        sname = metric.name + "_total" if mtype == "counter" else metric.name
        out: List[str] = []
        order: Optional[List[str]] = None
        for sample in metric.samples:
            if (
                sample.timestamp is not None
                or sample.exemplar is not None
                or sample.name != sname
            ):
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
        out.extend(
            blocks
        )  # apart from the header: the same objects as the last render's (GzipBlocks.blocks)
    return out


def _openmetrics_pieces(metrics: List[object], chunks: List[List[str]]) -> List[str]:
    # OpenMetrics names a counter's family without _total, and escapes '"' in HELP too.
    out: List[str] = []
    for metric, blocks in zip(metrics, chunks):
        name = metric.name
        doc = (
            metric.documentation.replace("\\", r"\\")
            .replace("\n", r"\n")
            .replace('"', r"\"")
        )
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
        out.extend(blocks)
    out.append("# EOF\n")
    return out


def text_format(metrics: List[object]) -> bytes:
    """The text format 0.0.4, byte for byte what prometheus_client's generate_latest writes,
    at a fraction of its cost (see _sample_chunks)."""
    chunks = _sample_chunks(metrics)
    return (
        generate_latest(Frozen(metrics))
        if chunks is None
        else "".join(_text_pieces(metrics, chunks)).encode()
    )


def openmetrics_format(metrics: List[object]) -> bytes:
    """OpenMetrics 1.0.0, byte for byte what prometheus_client.openmetrics's generate_latest
    writes (escaping underscores or allow-utf-8: the same for legacy names)."""
    chunks = _sample_chunks(metrics)
    if chunks is None:
        return openmetrics.generate_latest(Frozen(metrics))
    return "".join(_openmetrics_pieces(metrics, chunks)).encode()


def fast_kind(encoder: Callable) -> Optional[str]:
    """Which of our formatters makes what `encoder` (from choose_encoder) would: "text",
    "openmetrics", or None (anything else, e.g. escaping=dots or values, which rewrite
    names; a later OpenMetrics version): that is left to the encoder itself."""
    func, keywords = (
        getattr(encoder, "func", encoder),
        getattr(encoder, "keywords", {}) or {},
    )
    if keywords.get("escaping", openmetrics.UNDERSCORES) not in (
        openmetrics.UNDERSCORES,
        openmetrics.ALLOWUTF8,
    ):
        return None
    if func is generate_latest:
        return "text"
    if (
        func is openmetrics.generate_latest
        and keywords.get("version", "1.0.0") == "1.0.0"
    ):
        return "openmetrics"
    return None


class Frozen:
    """The families of one render, for the encoders that take something with collect()."""

    def __init__(self, metrics: List[object]):
        self._metrics = metrics

    def collect(self):
        return iter(self._metrics)


class Render:
    """One render's families and the bodies made from them, by (content type, gzip): each
    made at most once per render, from the sample lines collected once. Gzip reuses the
    blocks of the last render that did not change (`blocks`)."""

    def __init__(
        self, version: int, metrics: List[object], blocks: Optional[GzipBlocks] = None
    ):
        self.version = version
        self.made = time.monotonic()
        self.frozen = Frozen(metrics)
        self.chunks = _sample_chunks(metrics, blocks)
        self.blocks = blocks
        self.bodies: Dict[Tuple[str, bool], bytes] = {}
        self.built = 0  # bodies made (a test asserts scrapes make none)
        self.lock = threading.Lock()

    def pieces(self, encoder: Callable) -> Optional[List[str]]:
        """The body `encoder` would write, in pieces (each family's blocks), when our own
        formatters make it; None when prometheus_client's encoder must."""
        kind = fast_kind(encoder) if self.chunks is not None else None
        if kind is None:
            return None
        return (_text_pieces if kind == "text" else _openmetrics_pieces)(
            self.frozen._metrics, self.chunks
        )

    def encode(self, encoder: Callable, pieces: Optional[List[str]] = None) -> bytes:
        """The body `encoder` would write; `pieces` when already asked for."""
        pieces = self.pieces(encoder) if pieces is None else pieces
        return (
            encoder(self.frozen) if pieces is None else "".join(pieces).encode("utf-8")
        )

    def body(self, encoder: Callable, content_type: str, gzipped: bool) -> bytes:
        key = (content_type, gzipped)
        with self.lock:
            cached = self.bodies.get(key)
            if cached is None:
                pieces = self.pieces(encoder)
                raw = self.bodies.get((content_type, False))
                if raw is None:
                    raw = self.bodies[(content_type, False)] = self.encode(
                        encoder, pieces
                    )
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


class WantedBodies:
    """(content type, gzip) -> encoder of each body a scrape asked for lately (WANTED_GAPS):
    each render makes these. Only formats of our own formatters are remembered: a bounded
    set (the content type carries the Accept header's version, which a client could vary
    without end). Lately is by scraper (address and user agent, as scrape_clock.py): an HA
    pair's replicas ask seconds apart, and that gap is not either one's interval. And by the
    longer of a scraper's last two gaps: a pair that looks like one (a proxy's address, one
    Prometheus version) alternates the short gap with the long one."""

    def __init__(self) -> None:
        self._encoders: Dict[Tuple[str, bool], Callable] = {}
        # by body, by scraper: when it last asked, the gap before, and the gap before that
        self._asked: Dict[Tuple[str, bool], Dict[str, Tuple[float, float, float]]] = {}
        self._lock = (
            threading.Lock()
        )  # scrapes ask from their threads; the render thread forgets

    def __contains__(self, key: Tuple[str, bool]) -> bool:
        return key in self._encoders

    def keys(self) -> List[Tuple[str, bool]]:
        return list(self._encoders)

    def asked(self, key: Tuple[str, bool], encoder: Callable, who: str = "") -> None:
        if fast_kind(encoder) is None:
            return
        now = time.monotonic()
        with self._lock:
            scrapers = self._asked.setdefault(key, {})
            last = scrapers.get(who)  # (at, gap before it, the gap before that)
            if (
                last is None and len(scrapers) >= MAX_SCRAPERS
            ):  # a scan of the port: the stalest goes
                del scrapers[min(scrapers, key=lambda w: scrapers[w][0])]
            scrapers[who] = (now, now - last[0], last[1]) if last else (now, 0.0, 0.0)
            self._encoders.setdefault(key, encoder)

    def current(self) -> List[Tuple[Tuple[str, bool], Callable]]:
        """The bodies asked for lately; the others are forgotten."""
        now = time.monotonic()
        with self._lock:
            for key, scrapers in list(self._asked.items()):
                for who, (at, gap, gap_before) in list(scrapers.items()):
                    kept = min(
                        WANTED_AT_MOST_SECONDS,
                        max(WANTED_FOR_SECONDS, WANTED_GAPS * max(gap, gap_before)),
                    )
                    if now - at > kept:
                        del scrapers[who]
                if not scrapers:
                    del self._asked[key], self._encoders[key]
            return list(self._encoders.items())
