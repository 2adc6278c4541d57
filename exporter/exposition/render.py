"""/metrics, rendered when a scrape finds the model changed, and served as bytes.

A scrape reads the model's version: when it moved since the last render, the scrape
collects the registry once; otherwise it reuses that render. Each body (format and
encoding, negotiated as prometheus_client's own handler does) is made at most once per
render and kept until the next. Concurrent scrapes wait for one render under one lock.
"""

from __future__ import annotations

import gzip
import threading
from typing import Callable, Dict, Hashable, List, Optional, Set, Tuple
from urllib.parse import parse_qs

from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import CollectorRegistry

from exporter.exposition.bodies import encode

# Level 1 compresses a node's exposition 9x (level 6: 11x) in half level 6's time: a
# DaemonSet's CPU is worth more than a fifth more bytes per scrape.
GZIP_LEVEL = 1
# Bodies kept per render: an Accept header can name endless versions, each its own type.
MAX_BODIES = 8
_NOTHING = object()


class Exposition:
    """Serves `registry` via `wsgi_app`, rendered again when `version()` (a zero-argument
    callable returning a hashable that changes whenever the model does) has moved."""

    def __init__(self, registry: CollectorRegistry, version: Callable[[], Hashable]):
        self.registry = registry
        self.version = version
        self.renders = 0
        self._lock = threading.Lock()
        self._rendered: object = _NOTHING  # the version _metrics are of
        self._metrics: List[Metric] = []
        self._bodies: Dict[Tuple[str, bool], bytes] = {}

    def metrics(self) -> List[Metric]:
        """The families of the current model; call with the lock held."""
        version = self.version()
        if version != self._rendered:
            self._metrics = list(self.registry.collect())
            self._bodies = {}
            self._rendered = version
            self.renders += 1
        return self._metrics

    def body(
        self,
        encoder: Callable,
        content_type: str,
        gzipped: bool,
        names: Optional[Set[str]] = None,
    ) -> bytes:
        """What `encoder` writes for the current model (gzipped), or for the families
        named in `names` (a family's name or one of its samples')."""
        with self._lock:
            metrics = self.metrics()
            if names:
                chosen = [
                    m
                    for m in metrics
                    if m.name in names or any(s.name in names for s in m.samples)
                ]
                raw = encode(chosen, encoder)
                return gzip.compress(raw, GZIP_LEVEL) if gzipped else raw
            key = (content_type, gzipped)
            body = self._bodies.get(key)
            if body is None:
                raw = self._bodies.get((content_type, False)) or encode(
                    metrics, encoder
                )
                body = gzip.compress(raw, GZIP_LEVEL) if gzipped else raw
                if len(self._bodies) < MAX_BODIES:
                    self._bodies[(content_type, False)] = raw
                    self._bodies[key] = body
            return body

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
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT"))
        gzipped = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING"))
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        body = self.body(encoder, content_type, gzipped, set(names or ()))
        headers = [("Content-Type", content_type)]
        if gzipped:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]
