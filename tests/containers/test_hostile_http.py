"""The sidecar under the issue's HTTP attack, in the shape users deploy it: the project's image
with the sidecar manifest's --memory=96m, and 200 connections sending oversized heads (half of
them under the 1 MiB bound, dropped at the header deadline) and trickling a byte every 5 s,
opened again as soon as they are closed. A normal scrape answers within 1 s throughout, the
container is never OOM-killed, and its memory cgroup stays under the limit."""
from __future__ import annotations

import time
import urllib.request

import pytest

from tests.containers.conftest import FIGURES, Container
from tests.containers import engine as eng
from tests.system.test_http_front import BIG_HEADERS, Hostile

pytestmark = pytest.mark.timeout(600)


def test_200_hostile_connections_under_96m(images):
    with Container(eng.PROJECT_IMAGE, "--no-collector.gpu", run=["--memory=96m", "--read-only"],
                   prefix="hostile") as sidecar:
        url = f"http://{sidecar.ip}:9841/metrics"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if b"shmwatch_collector_duration_seconds" in response.read():
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, sidecar.logs()[-2000:]
            time.sleep(0.2)
        cgroup = f"/sys/fs/cgroup/memory/docker/{sidecar.id}"
        latencies = []
        with Hostile(9841, 100, host=sidecar.ip), Hostile(9841, 100, pad=BIG_HEADERS[:600000],
                                                          host=sidecar.ip) as slow:
            until = time.monotonic() + 30
            while time.monotonic() < until:
                started = time.monotonic()
                with urllib.request.urlopen(url, timeout=5) as response:
                    assert response.status == 200 and b"shmwatch_build_info" in response.read()
                latencies.append(time.monotonic() - started)
                time.sleep(0.1)
            dropped = slow.closed_by_server
        with open(f"{cgroup}/memory.max_usage_in_bytes") as f:
            peak = int(f.read())
        with open(f"{cgroup}/memory.failcnt") as f:
            failcnt = int(f.read())
        oom_killed = sidecar.inspect("{{.State.OOMKilled}}")
        running = sidecar.inspect("{{.State.Running}}")
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)]
    FIGURES["hostile HTTP at --memory=96m"] = (
        f"{len(latencies)} scrapes, p50 {latencies[len(latencies) // 2] * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
        f"max {latencies[-1] * 1000:.0f} ms; cgroup peak {peak / 2**20:.1f} MiB; slow heads dropped {dropped}")
    assert oom_killed == "false" and running == "true"
    assert latencies[-1] < 1.0, f"a scrape took {latencies[-1]:.2f}s"
    assert peak < 96 << 20 and failcnt == 0, (peak, failcnt)
    assert dropped >= 100
