"""Right-sizing in the shape users run it: a workload container whose shm peak is known, a
sidecar watching it, and `shmwatch check --recommend` reading the sidecar's high-water mark."""
from __future__ import annotations

import json
import time

import pytest

from tests.containers import engine as eng
from tests.containers.conftest import SERVER_IMAGE, Container, wait_for_inventory

pytestmark = pytest.mark.timeout(600)
MiB, GiB = 1 << 20, 1 << 30
PEAK = 300 * MiB
# Waits for /dev/shm/go, writes PEAK into one segment, holds it 1.5 s, frees it: a spike
# that is over long before anyone would look.
SPIKE = (
    "import os, time\n"
    "while not os.path.exists('/dev/shm/go'): time.sleep(0.05)\n"
    "fd = os.open('/dev/shm/psm_spike', os.O_CREAT | os.O_RDWR, 0o600)\n"
    f"os.posix_fallocate(fd, 0, {PEAK})\n"
    "time.sleep(1.5)\n"
    "os.close(fd); os.unlink('/dev/shm/psm_spike'); os.unlink('/dev/shm/go')\n"
    "print('done', flush=True)\n"
    "time.sleep(3600)\n"
)


def test_a_known_peak_is_recommended_with_headroom(images):
    with Container(SERVER_IMAGE, "-c", SPIKE, prefix="spike",
                   run=["--ipc=shareable", "--shm-size=512m", "--entrypoint", "python3"]) as workload:
        share = [f"--ipc=container:{workload.name}", f"--pid=container:{workload.name}"]
        with Container(eng.PROJECT_IMAGE, "--no-collector.gpu", "--poll-interval=200ms", prefix="sidecar",
                       run=[*share, "--read-only", "--user", "0:0", "--cap-drop", "ALL", "--cap-add",
                            "SYS_PTRACE"]) as sidecar:
            wait_for_inventory(sidecar, segments=0)
            eng.docker("exec", workload.name, "touch", "/dev/shm/go")
            deadline = time.monotonic() + 30
            while "done" not in workload.logs():
                assert time.monotonic() < deadline, workload.logs()[-2000:]
                time.sleep(0.2)
            done = eng.docker("run", "--rm", "--label", eng.LABEL, *share, eng.PROJECT_IMAGE, "check",
                              "--recommend", f"--exporter.url=http://{sidecar.ip}:9841/metrics", "--output=json",
                              "--no-collector.gpu", check=False, timeout=60)
    report = json.loads(done.stdout)
    [rec] = [r for r in report["recommendations"] if r["mount"] == "/dev/shm"]
    assert rec["source"] == "exporter", rec
    assert rec["observed_peak_bytes"] >= PEAK
    assert PEAK <= rec["recommended_size_bytes"] <= 1.5 * PEAK + GiB, rec
