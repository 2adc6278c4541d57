"""/metrics: the catalogue's families as prometheus_client's text lines, rendered when a
scrape finds the model's version moved; each body (format and encoding negotiated as
prometheus_client does) kept until the next. Text 0.0.4 and OpenMetrics 1.0.0 (legacy
names, no timestamps): those lines joined, byte for byte its encoders' output; other
formats: the encoder's."""

import functools
import gzip
import itertools
import re
import threading
from dataclasses import dataclass, field, replace
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Hashable,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    cast,
)
from urllib.parse import parse_qs

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from exporter.exposition.heads import Answer
from exporter.model.catalogue import lookup, node_labels

# The text format 0.0.4's type, as prometheus_client 0.17 (the floor) names it CONTENT_TYPE_LATEST
# and later versions CONTENT_TYPE_PLAIN_0_0_4.
CONTENT_TYPE_PLAIN_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
# Level 1: 9x smaller (level 6: 11x) in half the CPU; a DaemonSet's CPU outweighs bytes.
GZIP_LEVEL = 1
MAX_BODIES = 8  # per render: Accept can name endless versions, each its own type
# The content types whose bodies are the sample lines joined, by media type and escaping.
JOINED_FORMATS = {"text/plain": "text", "application/openmetrics-text": "openmetrics"}
LEGACY_ESCAPINGS = ("underscores", "allow-utf-8")
QVALUE = re.compile(r"0(\.[0-9]{0,3})?|1(\.0{0,3})?")  # RFC 9110's weight
# What render.py's app reads of WSGI's environ, and WSGI's start_response.
Environ = Dict[str, str]
StartResponse = Callable[..., object]
# A value as the text format writes it (prometheus_client's, untyped there).
go_float = cast(Callable[[float], str], floatToGoString)


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
            return self.template % (*ordered, go_float(value))
        present = tuple(map(bool, ordered))
        template = self.templates.get(present)
        if template is None:
            template = self.templates.setdefault(present, self._template(present))
        return template % (*filter(None, ordered), go_float(value))


@functools.lru_cache(maxsize=None)
def shape(name: str, node_mode: bool) -> Shape:
    entry = lookup(name)  # a counter's samples are named as its entry is: *_total
    added = node_labels(entry) if node_mode else ()
    return Shape(name, entry.labels + added, entry.type, entry.help, added)


class Family(Metric):
    """One family of a render: its Shape and lines (encode joins them). `samples`, for
    prometheus_client's other encoders and whoever reads a registry, parses the lines back
    when first read."""

    def __init__(self, form: Shape, lines: List[str]) -> None:
        super().__init__(form.name, form.documentation, form.type)
        self.shape, self.lines = form, lines
        self._parsed: Optional[List[Sample]] = None

    @property
    def sample_name(self) -> str:
        return self.shape.sample_name

    @property
    def samples(self) -> List[Sample]:
        if self._parsed is None:
            text = "".join(self.lines)
            found = text_string_to_metric_families(text)
            self._parsed = [s for f in found for s in f.samples]
        return self._parsed

    @samples.setter
    def samples(self, value: List[Sample]) -> None:
        # Metric.__init__ sets []: parsed again from the lines when read.
        self._parsed = value or None


Row = Tuple[Any, ...]  # parts_of's: (key, labels, *inputs)


@dataclass(frozen=True)
class Part:
    """What one row's make added: the families' names, each with its lines joined."""

    names: Tuple[str, ...]
    texts: Tuple[str, ...]


@dataclass(frozen=True)
class Made:
    """A row's labels and inputs, and the part they made."""

    inputs: Row
    part: Part


@dataclass(frozen=True)
class Site:
    """One parts_of call's rows and what they made: lines by family name, each row's Made
    by key, and the objects the rows were made from (kept: their ids stay theirs)."""

    rows: List[Row]
    lines: Dict[str, List[str]]
    made: Dict[Hashable, Made]
    same: Tuple[object, ...] = ()
    ids: Tuple[int, ...] = ()


@dataclass
class Memo:
    """A render's parts, for the next: each parts_of call's Site by its make, each row's
    Made by its key."""

    sites: Dict[Callable[..., None], Site] = field(default_factory=dict)
    rows: Dict[Hashable, Made] = field(default_factory=dict)


class Families:
    """Lines by family name, in the order first added. Node mode's labels come from `labels`
    (every sample here carries them where its family has them) and a sample's `extra`.
    `last` and `made` are the last and this render's parts (`parts_of`). Only the families
    in `exposed` are kept (None: every one)."""

    def __init__(
        self,
        node_mode: bool = False,
        last: Optional[Memo] = None,
        labels: Optional[Dict[str, str]] = None,
        made: Optional[Memo] = None,
        exposed: Optional[FrozenSet[str]] = None,
    ) -> None:
        self.node_mode, self.labels = node_mode, labels or {}
        self.last = Memo() if last is None else last
        self.made = Memo() if made is None else made
        self.parts: Dict[str, List[str]] = {}  # family name -> lines, joined in runs
        self.exposed = exposed

    def wants(self, name: str) -> bool:
        """Whether the family is exposed: a renderer may skip the work of one that is not."""
        return self.exposed is None or name in self.exposed

    def add(
        self,
        name: str,
        labels: Sequence[str],
        value: float,
        extra: Optional[Dict[str, str]] = None,
    ) -> None:
        if self.exposed is not None and name not in self.exposed:
            return
        form = shape(name, self.node_mode)
        if form.added:
            given = {**self.labels, **extra} if extra else self.labels
            labels = (*labels, *[given.get(k, "") for k in form.added])
        self.parts.setdefault(name, []).append(form.line(labels, value))

    def parts_of(
        self,
        make: Callable[..., None],
        rows: Iterable[Row],
        same: Tuple[object, ...] = (),
    ) -> None:
        """For each row (key, labels, *inputs), what `make(child, *inputs)` adds to a child
        carrying `labels`, or what it added for `key` last render when `labels` and `inputs`
        are as they were (`make` reads nothing else). The rows are not even made when made
        from `same` alone, each the very object it was."""
        ids = tuple(map(id, same))  # `same` is kept with them: the ids stay theirs
        site = self.last.sites.get(make)
        if not same or site is None or site.ids != ids:
            listed = list(rows)
            if site is None or site.rows != listed:
                site = self._site(make, listed)
            # These rows are kept, not equal older ones: the next render's are often these.
            site = replace(site, rows=listed, same=same, ids=ids)
        self.made.sites[make] = site
        self.made.rows.update(site.made)
        for name, lines in site.lines.items():
            self.parts.setdefault(name, []).extend(lines)

    def _site(self, make: Callable[..., None], rows: List[Row]) -> Site:
        """The rows' parts: last render's for a row whose labels and inputs are as they
        were, else made again."""
        parts: List[Part] = []
        now: Dict[Hashable, Made] = {}
        for row in rows:
            inputs = row[1:]
            known = self.last.rows.get(row[0])
            if known is None or known.inputs != inputs:
                known = Made(inputs=inputs, part=self._part(make, row))
            now[row[0]] = known
            parts.append(known.part)
        return Site(rows=rows, lines=joined_runs(parts), made=now)

    def _part(self, make: Callable[..., None], row: Row) -> Part:
        staged = Families(self.node_mode, labels=row[1], exposed=self.exposed)
        make(staged, *row[2:])
        return Part(
            names=tuple(staged.parts), texts=tuple(map("".join, staged.parts.values()))
        )

    def __iter__(self) -> Iterator[Family]:
        for name, lines in self.parts.items():
            yield Family(shape(name, self.node_mode), lines)


def joined_runs(parts: List[Part]) -> Dict[str, List[str]]:
    """Lines by family name, in the parts' order; a run of parts of the same names goes in
    at once."""
    lines: Dict[str, List[str]] = {}
    for names, run in itertools.groupby(parts, key=lambda part: part.names):
        for name, texts in zip(names, zip(*(part.texts for part in run))):
            lines.setdefault(name, []).extend(texts)
    return lines


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


def joined_format(content_type: str) -> Optional[str]:
    """The format ("text" or "openmetrics") when the negotiated content type's body is the
    sample lines joined (text 0.0.4 or 1.0.0, OpenMetrics 1.0.0, with an escaping that leaves
    legacy names as they are), else None: the encoder writes it."""
    media, *parameters = content_type.split(";")
    options = dict(p.strip().partition("=")[::2] for p in parameters)
    kind = JOINED_FORMATS.get(media.strip())
    legacy = options.get("escaping", "underscores") in LEGACY_ESCAPINGS
    if kind == "openmetrics" and options.get("version") != "1.0.0":
        return None
    return kind if legacy else None


class Snapshot(Collector):
    """A render's families, for an encoder of prometheus_client (it reads a registry)."""

    def __init__(self, metrics: Sequence[Family]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self.metrics)


def encode(
    metrics: Sequence[Family],
    encoder: Callable[[CollectorRegistry], bytes],
    content_type: str = CONTENT_TYPE_PLAIN_0_0_4,
) -> bytes:
    """The body `encoder` writes for `content_type` (as choose_encoder paired them): the
    families' lines joined, or the encoder's own for a format they do not serve."""
    kind = joined_format(content_type)
    if kind is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Snapshot(metrics))
        return encoder(registry)
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
    ) -> None:
        self.registry, self.version, self.renders = registry, version, 0
        self.exposed = exposed
        self._lock = threading.Lock()
        self._rendered = object()  # the version _metrics are of: none yet
        self._metrics: List[Family] = []
        self._bodies: Dict[Tuple[str, bool], bytes] = {}

    def ready(self, environ: Environ) -> Optional[Answer]:
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

    def wsgi_app(self, environ: Environ, start_response: StartResponse) -> List[bytes]:
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
                body = encode(chosen if names else self._metrics, encoder, content_type)
                # mtime 0: zlib writes the header, CRC and trailer in the call that compresses
                body = gzip.compress(body, GZIP_LEVEL, mtime=0) if gzipped else body
                if not names and len(self._bodies) < MAX_BODIES:
                    self._bodies[key] = body
        start_response("200 OK", answer_headers(content_type, gzipped))
        return [body]

    def _collected(self) -> List[Family]:
        # Its collectors (the model's, the web config's) render Families: encode joins their lines.
        families = cast(Iterable[Family], self.registry.collect())
        return [
            f for f in families if self.exposed is None or f.sample_name in self.exposed
        ]


def negotiate(
    environ: Environ,
) -> Tuple[Callable[[CollectorRegistry], bytes], str, bool]:
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
