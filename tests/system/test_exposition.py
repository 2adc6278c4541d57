"""/metrics renders when a scrape finds the model changed: one render per model version
however many scrape it, formats and gzip negotiated as prometheus_client does, and bytes
that are prometheus_client's own."""
import gzip
import json
import threading
import time
import urllib.parse
import urllib.request
from wsgiref.util import setup_testing_defaults

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from exporter.collectors.host_memory import HostMemoryCollector
from exporter.exposition.render import Family, Shape
from exporter.exposition.render import MAX_BODIES, Exposition, encode
from exporter.host.paths import Paths
from tests.conftest import FIXTURES, Exporter
from tests.helpers import registry_for
from tests.live import Prometheus

# What Debian bookworm's Prometheus (2.42) sends on every scrape, captured from a real one.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
CREATED = b'shmwatch_segment_events_total{class="nccl",event="created",mount="/dev/shm"} '


def get(app, accept=None, encoding=None, query=""):
    environ = {}
    setup_testing_defaults(environ)
    environ["QUERY_STRING"] = query
    if accept:
        environ["HTTP_ACCEPT"] = accept
    if encoding:
        environ["HTTP_ACCEPT_ENCODING"] = encoding
    seen = {}

    def start_response(status, headers):
        seen["status"], seen["headers"] = status, dict(headers)

    body = app(environ, start_response)
    # The body object itself when there is one: tests tell a served body from a rebuilt one.
    return seen["status"], seen["headers"], body[0] if len(body) == 1 else b"".join(body)


class Frozen:
    """Families, for the encoders (they take anything with collect())."""

    def __init__(self, metrics):
        self.metrics = metrics

    def collect(self):
        return iter(self.metrics)


def fixture_exposition():
    registry, harness = registry_for(HostMemoryCollector(Paths(procfs=f"{FIXTURES}/proc")))
    return registry, harness, Exposition(registry, harness.step.version)


def test_scrapes_serve_one_render_until_the_model_changes():
    registry, harness, exposition = fixture_exposition()
    bodies = {get(exposition.wsgi_app)[2] for _ in range(20)}
    assert exposition.renders == 1, "a scrape of the same model rendered again"
    assert bodies == {generate_latest(registry)}
    assert len({id(get(exposition.wsgi_app)[2]) for _ in range(5)}) == 1, "a body was made again"
    harness.state.count_event("/dev/shm", "nccl", "created")
    body = get(exposition.wsgi_app)[2]
    assert exposition.renders == 2 and CREATED + b"1.0" in body
    assert body == generate_latest(registry)
    assert get(exposition.wsgi_app, accept=PROMETHEUS_ACCEPT)[2] == openmetrics.generate_latest(registry)
    assert exposition.renders == 2


def test_changes_cost_nothing_until_a_scrape_and_every_scrape_sees_them():
    _, harness, exposition = fixture_exposition()
    threads = [threading.Thread(target=lambda: [harness.state.count_event("/dev/shm", "nccl", "created")
                                                for _ in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert exposition.renders == 0
    assert CREATED + b"800.0" in get(exposition.wsgi_app)[2]
    for i in range(801, 811):  # a scraper that hammers sees every change
        harness.state.count_event("/dev/shm", "nccl", "created")
        assert CREATED + f"{i}.0".encode() in get(exposition.wsgi_app)[2]


class Slow:
    """A collector whose collect takes `seconds` (and fails while `failing`)."""

    def __init__(self, seconds):
        self.seconds, self.calls, self.failing = seconds, 0, False

    def describe(self):
        return []

    def collect(self):
        self.calls += 1
        time.sleep(self.seconds)
        if self.failing:
            raise RuntimeError("broken render")
        yield Family(Shape("m_bytes", [], doc="doc"), [f"m_bytes {float(self.calls)}\n"])


def test_concurrent_scrapes_of_one_version_render_once():
    registry, slow = CollectorRegistry(auto_describe=False), Slow(0.2)
    registry.register(slow)
    version = [1]
    exposition = Exposition(registry, lambda: version[0])
    bodies = []
    scrapers = [threading.Thread(target=lambda: bodies.append(get(exposition.wsgi_app)[2])) for _ in range(8)]
    for t in scrapers:
        t.start()
    for t in scrapers:
        t.join()
    assert slow.calls == 1 and bodies == [b"# HELP m_bytes doc\n# TYPE m_bytes gauge\nm_bytes 1.0\n"] * 8
    version[0] = 2
    slow.failing = True  # a render that fails is not cached: the last good bytes are not served as current
    for _ in range(2):
        try:
            get(exposition.wsgi_app)
        except RuntimeError:
            pass
        else:
            raise AssertionError("served the last render's bytes for a new version")
    slow.failing = False
    assert get(exposition.wsgi_app)[2].endswith(b"m_bytes 4.0\n")


def test_a_render_keeps_a_bounded_number_of_bodies():
    """An Accept header can name endless OpenMetrics versions, each its own content type."""
    _, _, exposition = fixture_exposition()
    for minor in range(3 * MAX_BODIES):
        status, headers, body = get(exposition.wsgi_app, accept=f"application/openmetrics-text;version=1.{minor}.0",
                                    encoding="gzip")
        assert status == "200 OK" and gzip.decompress(body).endswith(b"# EOF\n")
    assert len(exposition._bodies) <= MAX_BODIES + 1


def test_negotiation_gzip_and_openmetrics():
    registry, _, exposition = fixture_exposition()
    plain = generate_latest(registry)
    status, headers, body = get(exposition.wsgi_app, encoding="gzip, deflate")
    assert status == "200 OK" and headers["Content-Encoding"] == "gzip"
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert gzip.decompress(body) == plain
    _, headers, body = get(exposition.wsgi_app, accept="application/openmetrics-text; version=1.0.0")
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n") and b"shmwatch_host_memory_total_bytes" in body
    _, _, body = get(exposition.wsgi_app, accept=PROMETHEUS_ACCEPT, query="name[]=shmwatch_build_info")
    assert body.count(b"# HELP") == 1 and body.endswith(b"# EOF\n")
    _, _, body = get(exposition.wsgi_app, query="name[]=shmwatch_host_memory_total_bytes")
    assert body.count(b"# HELP") == 1


def test_served_over_http_with_gzip():
    with Exporter(f"--path.procfs={FIXTURES}/proc", f"--path.sysfs={FIXTURES}/sys", "--shm.mount=/dev/shm",
                  "--no-collector.gpu", "--no-collector.segments") as exporter:
        request = urllib.request.Request(exporter.url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            text = gzip.decompress(response.read()).decode()
        assert "shmwatch_host_memory_total_bytes" in text
        plain = exporter.scrape_text()
        assert plain.startswith("# HELP") and "shmwatch_build_info" in plain


label_values = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12) | \
    st.sampled_from(['a"b', "back\\slash", "new\nline", "\\n", '"', "ü€", ""])
numbers = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-2**63, 2**63)


def with_lines(family, names):
    """`family` as render.Families makes them: each sample's line from the family's Shape,
    which leaves out a label whose value is empty (Prometheus stores none), as the samples
    then handed to prometheus_client's encoders do."""
    shape = Shape(family.samples[0].name, names)
    family.lines = [shape.line([s.labels[n] for n in names], s.value) for s in family.samples]
    family.samples = [s._replace(labels={k: v for k, v in s.labels.items() if v}) for s in family.samples]
    return family


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.permutations(["mount", "class", "a_label"]), st.integers(0, 3),
                          st.lists(st.tuples(st.lists(label_values, min_size=3, max_size=3), numbers), min_size=1,
                                   max_size=4)), max_size=4),
       st.text(max_size=20) | st.sampled_from(['say "hi"', "a\\b\nc", ""]))
def test_both_formats_are_prometheus_clients_byte_for_byte(families, doc):
    """Lines from a template in any label order (render.Families writes them in the
    catalogue's order, node labels last), joined, are what the encoders write."""
    metrics = []
    for i, (counter, order, nlabels, samples) in enumerate(families):
        names = order[:nlabels]
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        family = kind(f"m{i}_bytes", doc, labels=names)
        for values, value in samples:
            family.add_metric(values[:nlabels], value)
        metrics.append(with_lines(family, names))
    for accept in (None, PROMETHEUS_ACCEPT):
        encoder, content_type = choose_encoder(accept)
        assert encode(metrics, encoder, content_type) == encoder(Frozen(metrics)), accept


ACCEPTS = [None, "", "*/*", PROMETHEUS_ACCEPT, "application/openmetrics-text", "application/openmetrics-text; version=1.0.0",
           "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8", "application/openmetrics-text;version=0.0.1",
           "application/openmetrics-text;version=1.0.0;escaping=dots", "application/openmetrics-text;version=2.0.0",
           "text/plain;version=0.0.4", "text/plain;version=1.0.0;escaping=allow-utf-8", "text/plain;version=1.0.0",
           "application/json, text/plain;version=0.0.4;q=0.5"]


def test_every_accept_header_gets_what_prometheus_client_would_send():
    """Content type and bytes as prometheus_client's own handler: the formats joined from
    sample lines, and those left to prometheus_client (escaping=dots rewrites names),
    gzipped or not."""
    registry, _, exposition = fixture_exposition()
    for accept in ACCEPTS:
        encoder, content_type = choose_encoder(accept)
        for encoding in (None, "gzip"):
            status, headers, body = get(exposition.wsgi_app, accept=accept, encoding=encoding)
            assert status == "200 OK"
            assert headers["Content-Type"] == content_type, accept
            assert (gzip.decompress(body) if encoding else body) == encoder(registry), accept


def test_a_real_scrape_with_prometheus_accept_header_gets_openmetrics():
    with Exporter(f"--path.procfs={FIXTURES}/proc", f"--path.sysfs={FIXTURES}/sys", "--shm.mount=/dev/shm",
                  "--no-collector.gpu", "--no-collector.segments") as exporter:
        request = urllib.request.Request(exporter.url, headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
        for _ in range(2):  # the first asks for it; the second is made by a render
            with urllib.request.urlopen(request, timeout=5) as response:
                assert response.headers["Content-Type"] == choose_encoder(PROMETHEUS_ACCEPT)[1]
                assert response.headers["Content-Encoding"] == "gzip"
                text = gzip.decompress(response.read()).decode()
            assert text.endswith("# EOF\n")
            families = {f.name: f for f in text_string_to_metric_families(text)}  # raises on bad OpenMetrics
            assert families["shmwatch_host_memory_total_bytes"].type == "gauge"
            assert families["shmwatch_host_memory_total_bytes"].samples[0].value > 0
            assert families["shmwatch_cgroup_oom_kills"].type == "counter"


def test_real_prometheus_scrapes_openmetrics(tmp_path):
    with Exporter(f"--path.procfs={FIXTURES}/proc", f"--path.sysfs={FIXTURES}/sys", "--shm.mount=/dev/shm",
                  "--no-collector.gpu", "--no-collector.segments") as exporter, \
            Prometheus(str(tmp_path), [f"127.0.0.1:{exporter.port}"]) as prom:
        value = float(prom.wait_query("shmwatch_host_memory_total_bytes")[0]["value"][1])
        assert value == float(prom.wait_query("up")[0]["value"][1]) * value > 0
        with urllib.request.urlopen(f"{prom.url}/api/v1/targets", timeout=10) as response:
            target = json.load(response)["data"]["activeTargets"][0]
        assert target["health"] == "up" and target["lastError"] == "", target
        # A counter's family is named without _total only in OpenMetrics (# TYPE
        # shmwatch_cgroup_oom_kills counter); from the text format Prometheus would keep
        # shmwatch_cgroup_oom_kills_total: it parsed what Prometheus really asks for.
        query = urllib.parse.urlencode({"match_target": '{job="shmwatch"}'})
        with urllib.request.urlopen(f"{prom.url}/api/v1/targets/metadata?{query}", timeout=10) as response:
            metadata = {m["metric"]: m["type"] for m in json.load(response)["data"]}
        assert metadata.get("shmwatch_cgroup_oom_kills") == "counter", metadata
        assert "shmwatch_cgroup_oom_kills_total" not in metadata
        assert prom.wait_query("shmwatch_cgroup_oom_kills_total")






