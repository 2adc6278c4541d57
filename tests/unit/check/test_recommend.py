"""recommend.settings_for: the kubectl patch is a command to paste, its JSON one quoted
argument whatever the volume is named; the YAML line shows the name escaped."""
import json
import shlex
from types import SimpleNamespace

import pytest

from exporter.check.recommend import (
    SourcePeak,
    memory_limit_needed,
    parse_headroom,
    parse_window,
    peaks_from_exporter,
    recommend,
    recommendations,
    settings_for,
)
from exporter.model.step import MountView
from tests.behaviour.hostile_names import pasted
from tests.helpers import GiB, MiB, cgroup, usage, view


def test_the_patch_is_one_argument_whatever_the_volume_name(tmp_path):
    volume = "dshm'$(touch PWNED)'\x1b"
    settings = settings_for(1 << 30, volume, None)
    argv = pasted(settings["kubectl_patch"].replace("<name>", "web").encode(), str(tmp_path))
    assert argv[:6] == [b"kubectl", b"patch", b"deployment", b"web", b"--type=strategic", b"-p"]
    patch = json.loads(argv[6])
    assert patch["spec"]["template"]["spec"]["volumes"][0] == {
        "name": volume, "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    assert "name: dshm'$(touch PWNED)'\\x1b," in settings["kubernetes_volume"]
    assert shlex.split(settings_for(1 << 30, "dshm", None)["kubectl_patch"])[-1].startswith('{"spec"')


def test_the_memory_limit_needed_counts_what_is_not_shm():
    """Working set 390 MiB of which 60 MiB is shm, limit 400 MiB: a 75 MiB mount needs 330 +
    75 = 405 MiB of limit, which does not fit (with working set and shm swapped: 75, fits)."""
    assert memory_limit_needed(75 * MiB, 390 * MiB, 60 * MiB) == 405 * MiB
    assert memory_limit_needed(75 * MiB, 10 * MiB, 60 * MiB) == 75 * MiB  # less than shm: clamped
    assert memory_limit_needed(75 * MiB, 390 * MiB, 60 * MiB - 1) == 406 * MiB  # rounded up to MiB
    r = recommend(view(usage(256 * MiB, 60 * MiB), cgroup(390 * MiB, 400 * MiB)), 60 * MiB, "current", None, 1.25)
    assert (r.recommended_size_bytes, r.memory_limit_bytes, r.memory_limit_bytes_needed) == (
        75 * MiB, 400 * MiB, 405 * MiB)
    assert r.memory_limit_fits is False and r.observed_peak_bytes == 60 * MiB and r.notes == []
    doubled = recommend(view(usage(256 * MiB, 60 * MiB), cgroup(390 * MiB, 400 * MiB)), 60 * MiB, "current", None, 2.0)
    assert (doubled.recommended_size_bytes, doubled.memory_limit_bytes_needed) == (120 * MiB, 450 * MiB)
    assert r.settings["docker_run_memory"] == "docker run --memory=405m"
    assert r.settings["kubernetes_volume"].endswith("{name: dshm, emptyDir: {medium: Memory, sizeLimit: 75Mi}}]")
    fits = recommend(view(usage(256 * MiB, 60 * MiB), cgroup(390 * MiB, 405 * MiB), {"volume": "cache"}),
                     60 * MiB, "exporter", None, 1.25, "a note")
    assert fits.memory_limit_fits is True and "docker_run_memory" not in fits.settings
    assert "name: cache," in fits.settings["kubernetes_volume"] and fits.notes == ["a note"]
    unlimited = recommend(view(usage(256 * MiB, 0), cgroup(10 * MiB, None)), -5, "current", None, 1.25)
    assert unlimited.memory_limit_fits is None and unlimited.observed_peak_bytes == 0
    assert unlimited.memory_limit_bytes_needed == 1 * MiB + 10 * MiB  # the 1 MiB floor of a size
    none = recommend(view(usage(256 * MiB, 0)), 3 * GiB, "prometheus", "7d", 1.25)
    assert none.memory_limit_bytes is None and none.memory_limit_fits is None and none.window == "7d"
    assert none.recommended_size_bytes == 4 * GiB and none.current_size_bytes == 256 * MiB


def test_recommended_size_and_settings():
    def size(peak, headroom=1.25):
        return recommend(view(usage(256 * MiB, 0)), peak, "current", None, headroom).recommended_size_bytes

    assert size(60 * MiB) == 75 * MiB
    assert size(60 * MiB, 2.0) == 120 * MiB
    assert size(900 * MiB) == 2 * GiB  # 1125 MiB: whole GiB above 1 GiB
    s = settings_for(75 * MiB, "dshm", None)
    assert s["docker_run"] == "docker run --shm-size=75m" and s["compose"] == "shm_size: 75m"
    assert '"sizeLimit":"75Mi"' in s["kubectl_patch"] and set(s) == {
        "docker_run", "compose", "kubernetes_volume", "kubectl_patch"}
    m = settings_for(2 * GiB, "v", 3 * GiB)
    assert m["compose_memory"] == "mem_limit: 3g" and m["kubernetes_memory_limit"].endswith("--limits=memory=3Gi")


def test_recommendations_take_the_higher_current_use():
    extra = SimpleNamespace(prometheus_selector="", recommend_window="7d", prometheus_url=None,
                            exporter_url=None, recommend_headroom=1.25, require_shm=None)
    views = [view(usage(256 * MiB, 40 * MiB, "/a"), max_used=80 * MiB), view(usage(256 * MiB, 8 * MiB, "/b")),
             MountView("/c", {}, None, None, None, None, None, None, None, None)]
    recs, notes = recommendations(SimpleNamespace(mounts=views), extra)
    assert [(r.mount, r.observed_peak_bytes, r.source) for r in recs] == [("/a", 40 * MiB, "current"),
                                                                           ("/b", 8 * MiB, "current")]
    assert notes == [] and recs[0].recommended_size_bytes == 50 * MiB


def test_recommend_flags():
    assert parse_window("7d") == "7d" and parse_window("1h30m") == "1h30m"
    for bad in ("7", "a week", "7d "):
        with pytest.raises(ValueError, match=r"^not a Prometheus duration: '.*' \(e.g. 7d, 36h\)$"):
            parse_window(bad)
    assert parse_headroom("1") == 1.0 and parse_headroom("10") == 10.0
    for bad in ("0.99", "10.5"):
        with pytest.raises(ValueError, match="^must be between 1 and 10$"):
            parse_headroom(bad)


# --- where the peak comes from: Prometheus, a running exporter, this run ------------------------
class Peers:
    """A Prometheus query API and an exporter's /metrics on loopback, answering from tables."""

    def __init__(self, prometheus, exporter, status="success"):
        import http.server
        import json
        import threading
        import urllib.parse

        peers = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                if url.path == "/api/v1/query":
                    query = urllib.parse.parse_qs(url.query)["query"][0]
                    peers.queries.append(query)
                    result = [{"metric": {}, "value": [0, str(v)]}
                              for mount, values in prometheus.items() if f'mount="{mount}"' in query
                              for v in values]
                    body = json.dumps({"status": status, "error": "bad query", "data": {"resultType": "vector", "result": result}})
                else:
                    body = "".join(f'shmwatch_mount_max_used_bytes{{mount="{m}"}} {v}\n' for m, v in exporter.items())
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.queries = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def soon():
    import time
    return time.monotonic() + 30  # `shmwatch check --timeout`'s deadline


def extra(prometheus=None, exporter=None, selector=""):
    return SimpleNamespace(prometheus_selector=selector, recommend_window="7d", prometheus_url=prometheus,
                           exporter_url=exporter, recommend_headroom=1.25, require_shm=None)


def test_the_peak_comes_from_the_best_source_that_has_it():
    prom = Peers({"/a": [100 * MiB], "/b": [20 * MiB, 24 * MiB], "/d": [10 * MiB], "/e": [0]},
                 {"/b": 30 * MiB, "/c": 16 * MiB})
    try:
        views = [view(usage(GiB, 1 * MiB, m), max_used=mu) for m, mu in
                 (("/a", 2 * MiB), ("/b", None), ("/c", 3 * MiB), ("/d", 12 * MiB), ("/e", 0), ("/f", None))]
        recs, notes = recommendations(SimpleNamespace(mounts=views), extra(prom.url, prom.url + "/metrics"), soon())
        got = {r.mount: (r.source, r.window, r.observed_peak_bytes, r.notes) for r in recs}
        assert got["/a"] == ("prometheus", "7d", 100 * MiB, [])
        # Two series and no selector: another pod's /dev/shm may be one; the exporter's instead.
        assert got["/b"] == ("exporter", None, 30 * MiB, [])
        assert notes == ["Prometheus not used for /b: 2 series match; name this workload's with "
                         "--prometheus.selector"]
        assert got["/c"] == ("exporter", None, 16 * MiB, [])
        assert got["/d"] == ("current", None, 12 * MiB,
                             ["the current use is above what prometheus recorded: it is the peak"])
        assert got["/e"] == ("prometheus", "7d", 0, [])  # a peak of 0 is a peak
        assert got["/f"][0] == "current" and got["/f"][3] == [
            "no recorded peak: this is the current use only, a spike that is over is not seen"]
        assert prom.queries[0] == 'max_over_time(shmwatch_mount_peak_used_bytes{mount="/a"}[7d])'
        recs, notes = recommendations(SimpleNamespace(mounts=views[1:2]),
                                      extra(prom.url + "/", None, '{instance="x"}'), soon())
        assert prom.queries[-1] == 'max_over_time(shmwatch_mount_peak_used_bytes{mount="/b", instance="x"}[7d])'
        assert (recs[0].source, recs[0].observed_peak_bytes, notes) == ("prometheus", 24 * MiB, [])
        assert recs[0].notes == ["2 series matched this mount; the highest was taken (narrow them with "
                                 "--prometheus.selector)"]
    finally:
        prom.close()


def test_require_shm_raises_every_recommendation():
    """--require-shm is a floor wherever the peak comes from: a recorded peak, the current use
    alone, or the current use above what was recorded."""
    prom = Peers({"/a": [100 * MiB], "/d": [10 * MiB]}, {})
    try:
        views = [view(usage(GiB, 1 * MiB, m), max_used=mu) for m, mu in
                 (("/a", 2 * MiB), ("/d", 12 * MiB), ("/f", None))]
        wanted = extra(prom.url)
        wanted.require_shm = 2 * GiB
        recs, _ = recommendations(SimpleNamespace(mounts=views), wanted, soon())
        got = {r.mount: (r.source, r.observed_peak_bytes, r.recommended_size_bytes) for r in recs}
        assert got == {"/a": ("prometheus", 100 * MiB, 2 * GiB), "/d": ("current", 12 * MiB, 2 * GiB),
                       "/f": ("current", 1 * MiB, 2 * GiB)}
    finally:
        prom.close()


def test_a_source_that_fails_is_named_and_skipped():
    broken = Peers({"/a": [5 * MiB]}, {}, status="error")
    try:
        views = [view(usage(GiB, 2 * MiB, "/a"))]
        recs, notes = recommendations(SimpleNamespace(mounts=views), extra(broken.url, broken.url + "/metrics"), soon())
        assert [(r.source, r.observed_peak_bytes) for r in recs] == [("current", 2 * MiB)]
        assert notes[0].startswith(f"Prometheus not used: {broken.url}/api/v1/query?query=max_over_time")
        assert notes[0].endswith(": the query failed: bad query")
        assert notes[1] == (f"exporter not used: {broken.url}/metrics: no shmwatch_mount_max_used_bytes (an older "
                            "shmwatch?)")
    finally:
        broken.close()
    recs, notes = recommendations(SimpleNamespace(mounts=views), extra("http://127.0.0.1:9"), soon())
    assert notes[0].startswith("Prometheus not used: http://127.0.0.1:9/api/v1/query?query=max_over_time")


def test_without_a_deadline_the_sources_are_asked_and_awaited():
    """No deadline (math.inf, the default): an infinite socket or lock timeout overflows (it
    raised OverflowError out of recommendations(), and made each source a note)."""
    prom = Peers({"/a": [100 * MiB]}, {"/a": 40 * MiB})
    try:
        views = [view(usage(GiB, 1 * MiB, "/a"))]
        recs, notes = recommendations(SimpleNamespace(mounts=views), extra(prom.url, prom.url + "/metrics"))
        assert [(r.source, r.observed_peak_bytes) for r in recs] == [("prometheus", 100 * MiB)], notes
        assert notes == []
        assert peaks_from_exporter(prom.url + "/metrics") == {"/a": SourcePeak(peak_bytes=40 * MiB, series=1)}
    finally:
        prom.close()
