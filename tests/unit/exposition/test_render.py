"""render.py: gzip by Accept-Encoding's weights; the answers ready without a render; which
formats are the lines joined; a family's samples read back from its lines."""

import threading
import time

import pytest
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from exporter.exposition.render import (
    Exposition,
    Families,
    Family,
    Part,
    encode,
    gzip_wanted,
    joined_format,
    joined_runs,
    shape,
)
from tests.system.test_exposition import get


@pytest.mark.parametrize("header,wanted", [
    ("gzip", True), ("gzip, deflate, br", True), ("GZIP", True), ("gzip;q=0.5", True), ("gzip;q=1.000", True),
    ("*", True), ("gzip, identity", True), ("gzip;q=0, gzip", True),
    (None, False), ("", False), ("deflate", False), ("x-gzip", False),
    ("gzip;q=0", False), ("gzip; q=0.000", False), ("gzip;Q=0", False), ("*;q=0", False),
    ("identity, gzip;q=0", False), ("gzip;q=0, *", False),  # gzip named at 0: the * does not count
    ("gzip;q=0.5, identity", False),  # identity preferred
    ("gzip;q=abc", False), ("gzip;q=1.1", False), ("gzip;q=0.0001", False),  # weights that do not parse
])
def test_gzip_is_served_by_accept_encodings_weights(header, wanted):
    assert gzip_wanted(header) is wanted


class Gate:
    """A collector whose collect() waits for `open`: a render in progress, held."""

    def __init__(self):
        self.open, self.waiting = threading.Event(), threading.Event()

    def collect(self):
        self.waiting.set()
        self.open.wait(10)
        families = Families()
        families.add("shmwatch_web_config_last_reload_successful", [], 1)
        return list(families)


def test_ready_gives_only_a_body_a_render_made_and_never_waits():
    """The front's loop answers from ready(): the very body wsgi_app made for this version,
    format and encoding, or None at once (nothing made yet, the version moved, another
    format, a query, a render holding the lock)."""
    registry, version, gate = CollectorRegistry(auto_describe=False), [0], Gate()
    registry.register(gate)
    exposition = Exposition(registry, version=lambda: version[0])
    plain = {"PATH_INFO": "/metrics", "HTTP_ACCEPT_ENCODING": "gzip"}
    assert exposition.ready(plain) is None  # nothing rendered
    gate.open.set()
    status, headers, body = get(exposition.wsgi_app, encoding="gzip")
    answer = exposition.ready(plain)
    assert answer is not None and answer.body is body and dict(answer.headers) == headers
    assert answer.status == status == "200 OK"
    assert exposition.ready({**plain, "HTTP_ACCEPT": "application/openmetrics-text;version=1.0.0"}) is None
    assert exposition.ready({**plain, "QUERY_STRING": "name[]=shmwatch_build_info"}) is None
    version[0] += 1
    assert exposition.ready(plain) is None  # the model moved: a render is due
    gate.open.clear()
    rendering = threading.Thread(target=get, args=(exposition.wsgi_app,), kwargs={"encoding": "gzip"})
    rendering.start()
    try:
        assert gate.waiting.wait(10)
        started = time.monotonic()
        assert exposition.ready(plain) is None
        assert time.monotonic() - started < 0.1, "ready() waited for a render"
    finally:
        gate.open.set()
        rendering.join(10)
    assert exposition.ready(plain) is not None


def test_a_label_with_no_value_is_left_out_of_its_line():
    """Prometheus stores no empty label: writing one is bytes for nothing on every scrape."""
    from exporter.exposition.render import Shape

    shape = Shape("shmwatch_mount_used_bytes", ["mount", "pod_uid", "volume", "container_id"])
    assert shape.line(["/dev/shm", "", "", ""], 1) == 'shmwatch_mount_used_bytes{mount="/dev/shm"} 1.0\n'
    assert shape.line(["", "u1", "dshm", ""], 2) == 'shmwatch_mount_used_bytes{pod_uid="u1",volume="dshm"} 2.0\n'
    assert shape.line(["", "", "", ""], 3) == "shmwatch_mount_used_bytes 3.0\n"
    assert shape.line(["/a", "u", "v", "c"], 4) == \
        'shmwatch_mount_used_bytes{container_id="c",mount="/a",pod_uid="u",volume="v"} 4.0\n'
    assert shape.line(['"', "", "", "\n"], 5) == 'shmwatch_mount_used_bytes{container_id="\\n",mount="\\""} 5.0\n'


def test_families_keep_only_the_exposed_ones():
    families = Families(exposed=frozenset({"shmwatch_build_info"}))
    families.add("shmwatch_build_info", ["1"], 1)
    families.add("shmwatch_mount_used_bytes", ["/dev/shm"], 2)
    assert [f.name for f in families] == ["shmwatch_build_info"]
    assert families.wants("shmwatch_build_info") and not families.wants("shmwatch_mount_used_bytes")
    assert Families().wants("shmwatch_mount_used_bytes")  # None: every family


def test_the_exposition_shows_only_the_exposed_families_of_every_collector():
    """Families of a collector other than the model's (the web config's reload) too."""
    registry, gate = CollectorRegistry(auto_describe=False), Gate()
    gate.open.set()
    registry.register(gate)
    for exposed, shown in ((None, True), (frozenset({"shmwatch_build_info"}), False)):
        exposition = Exposition(registry, version=lambda: 0, exposed=exposed)
        _, _, body = get(exposition.wsgi_app)
        assert (b"shmwatch_web_config_last_reload_successful 1.0" in body) is shown, body


@pytest.mark.parametrize("accept,joined", [
    (None, "text"), ("text/plain;version=0.0.4", "text"), ("text/plain;version=1.0.0", "text"),
    ("text/plain;version=1.0.0;escaping=allow-utf-8", "text"), ("text/plain;version=1.0.0;escaping=values", None),
    ("application/openmetrics-text", "openmetrics"), ("application/openmetrics-text;version=1.0.0", "openmetrics"),
    ("application/openmetrics-text;version=1.0.0;escaping=dots", None),
    ("application/openmetrics-text;version=2.0.0", None),
])
def test_the_formats_served_by_joined_lines_are_told_by_their_content_type(accept, joined):
    """choose_encoder pairs each encoder with its content type: what it says (media type,
    version, escaping) decides whether the lines joined are its body."""
    assert joined_format(choose_encoder(accept)[1]) == joined


def test_a_family_is_a_metric_whose_samples_are_its_lines_read_back():
    """For prometheus_client's other encoders and whoever reads a registry: a Metric, its
    counter named without _total, its samples parsed from the lines when read."""
    counter = Families()
    counter.add("shmwatch_cgroup_oom_kills_total", ["/kubepods/pod1"], 2)
    family = next(iter(counter))
    assert isinstance(family, Metric) and family.name == "shmwatch_cgroup_oom_kills"
    assert family.sample_name == "shmwatch_cgroup_oom_kills_total" and family.type == "counter"
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        ("shmwatch_cgroup_oom_kills_total", {"cgroup": "/kubepods/pod1"}, 2.0)]
    empty = Family(shape("shmwatch_mount_used_bytes", False), [])
    assert empty.samples == []


def test_other_formats_are_the_encoders_own_output():
    """escaping=dots rewrites names: left to prometheus_client, over the same samples."""
    families = Families()
    families.add("shmwatch_mount_used_bytes", ["/dev/shm"], 5)
    theirs = GaugeMetricFamily("shmwatch_mount_used_bytes", shape("shmwatch_mount_used_bytes", False).documentation,
                               labels=["mount"])
    theirs.add_metric(["/dev/shm"], 5)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(type("Theirs", (), {"collect": lambda self: [theirs]})())
    encoder, content_type = choose_encoder("application/openmetrics-text;version=1.0.0;escaping=dots")
    assert encode(list(families), encoder, content_type) == encoder(registry)


def test_runs_of_parts_of_the_same_families_are_joined_family_by_family():
    parts = [Part(("a", "b"), ("a1", "b1")), Part(("a", "b"), ("a2", "b2")), Part(("a",), ("a3",)),
             Part(("b", "a"), ("b4", "a4"))]
    assert joined_runs(parts) == {"a": ["a1", "a2", "a3", "a4"], "b": ["b1", "b2", "b4"]}
