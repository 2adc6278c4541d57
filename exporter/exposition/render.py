"""/metrics: the catalogue's families as prometheus_client's text lines, rendered when a
scrape finds the model's version moved; each body (format and encoding negotiated as
prometheus_client does) kept until the next. Text 0.0.4 and OpenMetrics 1.0.0 (legacy
names, no timestamps): those lines joined, byte for byte its encoders' output; other
formats: the encoder's."""

import functools
import gzip
import itertools
import operator
import re
import threading
from types import SimpleNamespace
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Hashable,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    cast,
)
from urllib.parse import parse_qs

from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from exporter.exposition.heads import Answer
from exporter.model.catalogue import lookup, node_labels

# Level 1: 9x smaller (level 6: 11x) in half the CPU; a DaemonSet's CPU outweighs bytes.
GZIP_LEVEL = 1
MAX_BODIES = 8  # per render: Accept can name endless versions, each its own type
JOINED_FORMATS = {generate_latest: "text", openmetrics.generate_latest: "openmetrics"}
QVALUE = re.compile(r"0(\.[0-9]{0,3})?|1(\.0{0,3})?")  # RFC 9110's weight


class Shape:
    """One family's kind, help, label names (node mode's last) and line template, which takes
    label values in that order and writes them sorted by name, as generate_latest does. A
    label whose value is empty is left out of its line (Prometheus stores none): node mode's
    labels a series has no value for, a mount named by its pod and volume."""

    def __init__(
        self,
        sample_name: str,
        names: Sequence[str],
        kind: str = "gauge",
        doc: str = "",
        added: Iterable[str] = (),
    ) -> None:
        self.sample_name, self.type = sample_name, kind
        # prometheus_client names a counter's family without the _total of its samples
        self.name = sample_name[: -len("_total")] if kind == "counter" else sample_name
        self.documentation, self.added, self.unit = doc, tuple(added), ""
        self.order = sorted(range(len(names)), key=names.__getitem__)
        self.sorted_names = tuple(names[i] for i in self.order)
        self.template = self._template((True,) * len(names))
        # Which labels a line has (a flag each, in sorted order) -> its template.
        self.templates: Dict[Tuple[bool, ...], str] = {}

    def _template(self, present: Tuple[bool, ...]) -> str:
        kept = [n for n, keep in zip(self.sorted_names, present) if keep]
        pairs = ",".join(f'{n}="%s"' for n in kept)
        return self.sample_name + ("{" + pairs + "}" if kept else "") + " %s\n"

    def line(self, values: Sequence[str], value: float) -> str:
        ordered = [
            values[i].replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
            for i in self.order
        ]
        if all(ordered):
            return self.template % (*ordered, floatToGoString(value))
        present = tuple(map(bool, ordered))
        template = self.templates.get(present)
        if template is None:
            template = self.templates.setdefault(present, self._template(present))
        return template % (*filter(None, ordered), floatToGoString(value))


@functools.lru_cache(maxsize=None)
def shape(name: str, node_mode: bool) -> Shape:
    entry = lookup(name)  # a counter's samples are named as its entry is: *_total
    added = node_labels(entry) if node_mode else ()
    return Shape(name, entry.labels + added, entry.type, entry.help, added)


class Family(Shape):
    """A Shape with one render's lines; `samples` (for other encoders) parses them back."""

    def __init__(self, form: Shape, lines: List[str]):
        vars(self).update(vars(form), lines=lines)

    @property
    def samples(self):
        text = "".join(self.lines)
        return [s for f in text_string_to_metric_families(text) for s in f.samples]


class Families:
    """Lines by family name, in the order first added. Node mode's labels come from `labels`
    (every sample here carries them where its family has them) and a sample's `extra`.
    `last` and `made` are the last and this render's parts by key (`parts_of`). Only the
    families in `exposed` are kept (None: every one)."""

    def __init__(
        self,
        node_mode: bool = False,
        last: Optional[Dict[Any, Tuple[Any, ...]]] = None,
        labels: Optional[Dict[str, str]] = None,
        made: Optional[Dict[Any, Tuple[Any, ...]]] = None,
        exposed: Optional[FrozenSet[str]] = None,
    ) -> None:
        self.node_mode, self.last, self.labels = node_mode, last or {}, labels or {}
        self.made: Dict[tuple, tuple] = {} if made is None else made
        self.parts: Dict[str, List[str]] = {}  # family name -> lines, joined in runs
        self.exposed: Optional[FrozenSet[str]] = exposed

    def wants(self, name: str) -> bool:
        """Whether the family is exposed: a renderer may skip the work of one that is not."""
        return self.exposed is None or name in self.exposed

    def add(self, name: str, labels: Sequence[str], value: float, extra=None) -> None:
        if self.exposed is not None and name not in self.exposed:
            return
        form = shape(name, self.node_mode)
        if form.added:
            given = {**self.labels, **extra} if extra else self.labels
            labels = (*labels, *[given.get(k, "") for k in form.added])
        self.parts.setdefault(name, []).append(form.line(labels, value))

    def parts_of(self, make: Callable, rows: Iterable[tuple], same: tuple = ()) -> None:
        """For each row (key, labels, *inputs), what `make(child, *inputs)` adds to a child
        carrying `labels`, or what it added for `key` last render when `labels` and `inputs`
        are as they were (`make` reads nothing else). The rows are not even made when made
        from `same` alone, each the very object it was."""
        ids = tuple(map(id, same))  # `same` is kept with them: the ids stay theirs
        # (rows, {name: lines}, {key: (inputs, part)}, same, ids)
        site = self.last.get(make)
        if not same or site is None or site[4] != ids:
            rows = list(rows)
            if site is None or site[0] != rows:
                site = (rows, *self._made(make, rows, self.last))
            # These rows are kept, not equal older ones: the next render's are often these.
            site = (rows, site[1], site[2], same, ids)
        self.made[make] = site
        self.made.update(site[2])
        for name, lines in site[1].items():
            self.parts.setdefault(name, []).extend(lines)

    def _made(self, make: Callable, rows: List[tuple], last: dict) -> tuple:
        made, now, lines = [], {}, {}
        for row in rows:
            inputs = row[1:]
            known = last.get(row[0])
            if known is None or known[0] != inputs:
                staged = Families(self.node_mode, labels=row[1], exposed=self.exposed)
                make(staged, *row[2:])
                texts = tuple(map("".join, staged.parts.values()))
                known = (inputs, (tuple(staged.parts), texts))
            now[row[0]] = (inputs, known[1])
            made.append(known[1])
        # part: (names, their lines joined); runs of parts with equal names go in at once
        for names, run in itertools.groupby(made, key=operator.itemgetter(0)):
            for name, texts in zip(names, zip(*(texts for _, texts in run))):
                lines.setdefault(name, []).extend(texts)
        return lines, now

    def __iter__(self) -> Iterable[Family]:
        for name, lines in self.parts.items():
            yield Family(shape(name, self.node_mode), lines)


def gzip_wanted(accept_encoding: Optional[str]) -> bool:
    """Whether Accept-Encoding asks for gzip, by its weights (RFC 9110 12.5.3): gzip's, or
    else `*`'s, above 0 and not below an identity listed higher. An element whose weight
    does not parse is ignored. (prometheus_client's gzip_accepted reads no weight.)"""
    weights: Dict[str, float] = {}
    for element in (accept_encoding or "").split(","):
        coding, *parameters = element.split(";")
        weight = 1.0
        for parameter in parameters:
            name, _, value = parameter.partition("=")
            if name.strip().lower() == "q":
                valid = QVALUE.fullmatch(value.strip())
                weight = float(valid[0]) if valid else -1.0
        coding = coding.strip().lower()
        weights[coding] = max(weight, weights.get(coding, -1.0))
    gzip_weight = weights.get("gzip", weights.get("*", 0.0))
    return gzip_weight > 0 and gzip_weight >= weights.get("identity", 0.0)


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
    """/metrics of the registry's families, those in `exposed` (None: every one)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        version: Callable[[], Hashable],
        exposed: Optional[FrozenSet[str]] = None,
    ):
        self.registry, self.version, self.renders = registry, version, 0
        self.exposed = exposed
        self._lock = threading.Lock()
        self._rendered = object()  # the version _metrics are of: none yet
        self._metrics: List[Family] = []
        self._bodies: Dict[Tuple[str, bool], bytes] = {}

    def ready(self, environ: Dict[str, str]) -> Optional[Answer]:
        """wsgi_app's answer if a render already made it (this version, format and
        encoding), at once: None when the version moved, a render holds the lock, or a
        query may pick families. Never waits: for the HTTP front's loop thread."""
        if environ.get("QUERY_STRING"):
            return None
        _, content_type, gzipped = negotiate(environ)
        if not self._lock.acquire(blocking=False):
            return None
        try:
            fresh = self.version() == self._rendered
            body = self._bodies.get((content_type, gzipped)) if fresh else None
        finally:
            self._lock.release()
        if body is None:
            return None
        return Answer("200 OK", answer_headers(content_type, gzipped), body)

    def wsgi_app(self, environ, start_response):
        """The negotiated body of every family, or of the families `name[]` names."""
        encoder, content_type, gzipped = negotiate(environ)
        names = set(parse_qs(environ.get("QUERY_STRING", "")).get("name[]", ()))
        key = (content_type, gzipped)
        with self._lock:
            version = self.version()
            if version != self._rendered:
                self._metrics, self._bodies = self._collected(), {}
                self._rendered, self.renders = version, self.renders + 1
            body = None if names else self._bodies.get(key)
            if body is None:
                chosen = [m for m in self._metrics if {m.name, m.sample_name} & names]
                body = encode(chosen if names else self._metrics, encoder)
                # mtime 0: zlib writes the header, CRC and trailer in the call that compresses
                body = gzip.compress(body, GZIP_LEVEL, mtime=0) if gzipped else body
                if not names and len(self._bodies) < MAX_BODIES:
                    self._bodies[key] = body
        start_response("200 OK", answer_headers(content_type, gzipped))
        return [body]

    def _collected(self) -> List[Family]:
        # The registry holds ModelCollector alone (encode reads each family's lines).
        families = cast(Iterable[Family], self.registry.collect())
        return [
            f for f in families if self.exposed is None or f.sample_name in self.exposed
        ]


def negotiate(environ: Dict[str, str]) -> Tuple[Callable[..., bytes], str, bool]:
    """(encoder, content type, gzipped) for a request, as prometheus_client chooses the
    format; gzip by Accept-Encoding's weights."""
    try:
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
    except Exception:  # e.g. "version=1.x": a header that says nothing, not a 500
        encoder, content_type = choose_encoder("")
    return encoder, content_type, gzip_wanted(environ.get("HTTP_ACCEPT_ENCODING"))


def answer_headers(content_type: str, gzipped: bool) -> List[Tuple[str, str]]:
    encoding = [("Content-Encoding", "gzip")] if gzipped else []
    return [("Content-Type", content_type), *encoding]
