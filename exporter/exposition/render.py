"""/metrics, rendered when a scrape finds the model's version moved; each body (format and
encoding negotiated as prometheus_client does) is kept until the next. Text 0.0.4 and
OpenMetrics 1.0.0 are the families' lines joined, byte for byte what prometheus_client's
encoders write; any other format is left to the encoder."""

import gzip
import threading
from types import SimpleNamespace
from typing import Callable, Dict, Hashable, List, Tuple
from urllib.parse import parse_qs

from prometheus_client.exposition import choose_encoder, generate_latest, gzip_accepted
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import CollectorRegistry

from exporter.exposition.families import Family

# Level 1 compresses a node's exposition 9x (level 6: 11x) in half level 6's time: a
# DaemonSet's CPU is worth more than a fifth more bytes per scrape.
GZIP_LEVEL = 1
# Bodies kept per render: an Accept header can name endless versions, each its own type.
MAX_BODIES = 8
JOINED_FORMATS = {generate_latest: "text", openmetrics.generate_latest: "openmetrics"}


def encode(metrics: List[Family], encoder: Callable) -> bytes:
    # prometheus-client >= 0.22 hands a partial with the version and the escaping; joined
    # lines serve the escapings that leave legacy names as they are.
    options = getattr(encoder, "keywords", None) or {}
    kind = JOINED_FORMATS.get(getattr(encoder, "func", encoder))
    legacy = options.get("escaping", "underscores") in ("underscores", "allow-utf-8")
    if kind is None or not legacy or options.get("version", "1.0.0") != "1.0.0":
        return encoder(SimpleNamespace(collect=lambda: iter(metrics)))
    out: List[str] = []
    for metric in metrics:
        name = metric.name
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        if kind == "openmetrics":
            doc = doc.replace('"', r"\"")
        elif metric.type == "counter":
            name += "_total"  # the text format names a counter's family by its sample
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
        out.extend(metric.lines)
    if kind == "openmetrics":
        out.append("# EOF\n")
    return "".join(out).encode("utf-8")


class Exposition:
    def __init__(self, registry: CollectorRegistry, version: Callable[[], Hashable]):
        self.registry, self.version, self.renders = registry, version, 0
        self._lock = threading.Lock()
        self._rendered = object()  # the version _metrics are of: none yet
        self._metrics: List[Family] = []
        self._bodies: Dict[Tuple[str, bool], bytes] = {}

    def wsgi_app(self, environ, start_response):
        """The negotiated body of every family, or of the families `name[]` names."""
        try:
            encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT"))
        except Exception:  # e.g. "version=1.x": a header that says nothing, not a 500
            encoder, content_type = choose_encoder(None)
        gzipped = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING"))
        names = set(parse_qs(environ.get("QUERY_STRING", "")).get("name[]", ()))
        key = (content_type, gzipped)
        with self._lock:
            version = self.version()
            if version != self._rendered:
                self._metrics, self._bodies = list(self.registry.collect()), {}
                self._rendered, self.renders = version, self.renders + 1
            body = None if names else self._bodies.get(key)
            if body is None:
                chosen = [m for m in self._metrics if {m.name, m.sample_name} & names]
                body = encode(chosen if names else self._metrics, encoder)
                # mtime 0: zlib writes the header, CRC and trailer in the call that compresses
                body = gzip.compress(body, GZIP_LEVEL, mtime=0) if gzipped else body
                if not names and len(self._bodies) < MAX_BODIES:
                    self._bodies[key] = body
        encoding = [("Content-Encoding", "gzip")] if gzipped else []
        start_response("200 OK", [("Content-Type", content_type), *encoding])
        return [body]
