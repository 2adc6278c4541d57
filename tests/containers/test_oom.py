"""A real OOM kill of a container in a pod's cgroup, counted for the pod by node mode.

Docker puts the container under `--cgroup-parent=/kubepods/burstable/pod<uid>` as the
kubelet's cgroupfs driver puts a pod's containers; `--memory=64m` is the container's own
limit. On cgroup v1 the kernel counts the kill in the container's memcg only, and that
cgroup is removed with the container: node mode must count it for the pod from the kernel
log, within 5 s, and PodOomKilled must fire on the series it exported.
"""
from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest
import yaml

from tests.conftest import Exporter, prerequisite_missing, remove_cgroup, select, value
from tests.containers.conftest import FIGURES, SERVER_IMAGE, Container, promtool_unit_test

pytestmark = pytest.mark.timeout(600)

V1_MEMORY = "/sys/fs/cgroup/memory"
HOG = "hog = []\nwhile True: hog.append(bytearray(1 << 20))\n"


def pod_oom_killed_test(series: str, values: str) -> subprocess.CompletedProcess:
    """promtool unit test of PodOomKilled on one exported series: fires 1 minute after the step."""
    labels = yaml.safe_load("{" + series[series.index("{") + 1:-1].replace('="', ': "') + "}")
    return promtool_unit_test([{"series": series, "values": values}], [
        {"eval_time": "2m", "alertname": "PodOomKilled", "exp_alerts": []},
        {"eval_time": "4m", "alertname": "PodOomKilled",
         "exp_alerts": [{"exp_labels": {**labels, "severity": "critical"}}]}])


def wait_for_log_line(path, *parts, timeout):
    """Whether a line of the exporter's whole log (node mode logs much) holds every part."""
    deadline = time.monotonic() + timeout
    while True:
        with open(path, errors="replace") as f:
            if any(all(part in line for part in parts) for line in f):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_node_mode_counts_a_container_oom_kill_for_its_pod(images):
    if not os.path.exists(os.path.join(V1_MEMORY, "memory.usage_in_bytes")):
        # CI's machine is cgroup v1: under CI=true this never skips there (and fails elsewhere).
        prerequisite_missing("written for cgroup v1 (dockerd running cgroupfs on v1); on cgroup v2 its checks run in "
                             "the VM tier, tests/vm/test_cgroup_v2_vm.py (test_a_container_oom_kill_is_counted_for_its_pod)")
    uid = str(uuid.uuid4())
    parent = f"/kubepods/burstable/pod{uid}"
    pod_dir = V1_MEMORY + parent
    # The kubelet makes the pod's cgroup before any container (the sandbox): so does the test,
    # so the pod's counter is seen at 0 before the kill, as a rate() needs.
    made = [d for d in (V1_MEMORY + "/kubepods", V1_MEMORY + "/kubepods/burstable") if not os.path.isdir(d)]
    os.makedirs(pod_dir, exist_ok=True)
    try:
        with Exporter("--mode=node", "--no-collector.gpu", "--no-collector.segments",
                      "--poll-interval=250ms") as node:
            # The pod's series by its pod_uid (node mode writes no cgroup path for a pod's).
            before = node.wait_for(lambda s: value(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == 0,
                                   timeout=10)
            assert value(before, "shmwatch_collector_success", collector="oom") == 1
            with Container(SERVER_IMAGE, "-c", HOG, run=[f"--cgroup-parent={parent}", "--memory=64m",
                                                         "--memory-swap=64m", "--entrypoint", "python3"],
                           prefix="oom") as hog:
                container_dir = f"{pod_dir}/{hog.id}"
                deadline = time.monotonic() + 60
                while hog.inspect("{{.State.Running}}") == "true" and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert hog.inspect("{{.State.OOMKilled}}") == "true", hog.logs()[-2000:]
                killed_at = time.monotonic()
            # Removed with the container: the only cgroup that counted the kill.
            remove_cgroup(container_dir)
            assert not os.path.exists(container_dir)
            after = node.wait_for(lambda s: value(s, "shmwatch_cgroup_oom_kills_total", pod_uid=uid) == 1,
                                  timeout=5)
            took = time.monotonic() - killed_at
            with open(pod_dir + "/memory.oom_control") as f:
                pod_counter = dict(line.split() for line in f.read().splitlines())["oom_kill"]
            FIGURES["oom kill"] = (f"counted for pod {uid[:8]} {took:.1f} s after docker saw it OOMKilled; the pod "
                                   f"cgroup's own v1 counter says {pod_counter}")
            (labels, _), = select(after, "shmwatch_cgroup_oom_kills_total", pod_uid=uid)
            assert labels == {"pod_uid": uid}
            # The count may come first from the container cgroup's own counter (read before the
            # cgroup went); the kernel log's line for the kill follows within a poll or two.
            assert wait_for_log_line(node.stderr_path, "OOM kill", f"pod {uid}", timeout=5), node.log()
        pairs = ", ".join(f'{k}="{v}"' for k, v in sorted({**labels, "instance": "node:9841",
                                                            "job": "shmwatch"}.items()))
        # What Prometheus would have scraped: the value before the kill for three minutes, then after.
        v0 = value(before, "shmwatch_cgroup_oom_kills_total", pod_uid=uid)
        v1 = value(after, "shmwatch_cgroup_oom_kills_total", pod_uid=uid)
        result = pod_oom_killed_test(f"shmwatch_cgroup_oom_kills_total{{{pairs}}}", f"{v0:.0f}x2 {v1:.0f}x4")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    finally:
        for directory in [d for d in os.listdir(pod_dir) if os.path.isdir(os.path.join(pod_dir, d))] \
                if os.path.isdir(pod_dir) else []:
            remove_cgroup(os.path.join(pod_dir, directory))
        remove_cgroup(pod_dir)
        for directory in reversed(made):
            remove_cgroup(directory)
