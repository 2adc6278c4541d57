"""One model step: /metrics and `shmwatch check` report the same numbers from the same model,
and discovery is a job of its own."""

import json
import os
import subprocess
import sys
import uuid

from tests.conftest import REPO, Exporter, Peer, fallocate, mounted_tmpfs, needs_root, select, value
from tests.helpers import pod_mount

MiB = 1 << 20


def check_json(*args):
    done = subprocess.run([sys.executable, "-m", "exporter", "check", "--no-collector.gpu", "--output=json", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1, 2), done.stderr
    return json.loads(done.stdout)


@needs_root
def test_check_and_metrics_agree_on_the_same_state():
    with mounted_tmpfs("64m") as shm:
        # A leak: a python_shm segment nobody holds.
        fallocate(os.path.join(shm, "psm_leaked01"), 3 * MiB)
        with Peer(shm, "mapped", "nccl-model01", str(5 * MiB)), Peer(shm, "fdonly", "torch_9_hidden", str(2 * MiB)):
            # 40 MiB of limit: the effective size is bounded by it, below the 64 MiB tmpfs.
            args = (f"--shm.mount={shm}", "--memory.limit-bytes=40Mi", "--no-collector.cgroup")
            report = check_json(*args)
            with Exporter(*args, "--no-collector.gpu", "--no-inotify") as exporter:
                s = exporter.scrape()
    [facts] = [f for f in report["shm"] if f["mount"] == shm]
    assert facts["used_bytes"] == value(s, "shmwatch_mount_used_bytes", mount=shm) >= 10 * MiB
    assert facts["effective_size_bytes"] == value(s, "shmwatch_mount_effective_size_bytes", mount=shm) == 40 * MiB
    by_class = {}
    for labels, v in select(s, "shmwatch_segment_bytes", mount=shm):
        by_class[labels["class"]] = by_class.get(labels["class"], 0) + v
    assert facts["bytes_by_class"] == {k: v for k, v in by_class.items()}
    assert by_class == {"nccl": 5 * MiB, "torch": 2 * MiB, "python_shm": 3 * MiB}
    assert facts["hidden_bytes"] == value(s, "shmwatch_segment_bytes", mount=shm, state="hidden",
                                          **{"class": "torch"}) == 2 * MiB
    assert [o["name"] for o in facts["orphans"]] == ["psm_leaked01"]
    assert value(s, "shmwatch_segments", mount=shm, state="orphan", **{"class": "python_shm"}) == 1
    assert value(s, "shmwatch_segment_bytes", mount=shm, state="orphan", **{"class": "python_shm"}) == \
        facts["orphans"][0]["bytes"] == 3 * MiB
    assert value(s, "shmwatch_segments", mount=shm, state="linked", **{"class": "nccl"}) == 1


@needs_root
def test_the_oldest_orphan_age_is_the_older_of_two():
    """Two leaked segments, an hour and a minute old: the metric is the hour, in whole seconds."""
    import time
    with mounted_tmpfs("16m") as shm:
        now = time.time()
        for name, age in (("nccl-old", 3600), ("psm_new", 60)):
            fallocate(os.path.join(shm, name), MiB)
            os.utime(os.path.join(shm, name), (now - age, now - age))
        with Exporter(f"--shm.mount={shm}", "--no-collector.gpu", "--no-inotify") as exporter:
            age = value(exporter.scrape(), "shmwatch_orphan_oldest_age_seconds", mount=shm)
            elapsed = time.time() - now
    # The inventory keeps an mtime in whole seconds (truncated): up to a second older.
    assert 3600 <= age <= 3600 + elapsed + 1, age  # the newer one's would be about 60


@needs_root
def test_node_mode_discovers_without_the_shm_mount_collector(tmp_path):
    """Discovery is its own job: with shm_mount off, a pod mounted later is inventoried, and
    forgotten once unmounted."""
    root = str(tmp_path)
    uid = str(uuid.uuid4())
    path = pod_mount(root, uid)
    # Every run a full scan (no refresh between): the leak is called within the test's 10 s.
    with Exporter("--mode=node", "--segments.full-scan-interval=0s", "--no-collector.gpu",
                  "--no-collector.shm_mount", "--no-collector.cgroup",
                  "--poll-interval=200ms", "--inventory-interval=300ms", "--metric-opt-in-list=shmwatch_.*") as exporter:
        assert not select(exporter.scrape(), "shmwatch_segments", pod_uid=uid)
        with mounted_tmpfs("16m", path=path):
            fallocate(os.path.join(path, "psm_late01"), MiB)
            s = exporter.wait_for(lambda s: value(s, "shmwatch_segment_bytes", pod_uid=uid, volume="dshm",
                                                  state="orphan", **{"class": "python_shm"}) == MiB, timeout=10)
            assert value(s, "shmwatch_inotify_active", pod_uid=uid) == 1
            assert value(s, "shmwatch_collector_success", collector="discovery") == 1
        exporter.wait_for(lambda s: not [k for k in s if dict(k[1]).get("pod_uid") == uid], timeout=10)
