"""What shmwatch costs the Prometheus that scrapes it: the default set, bounded labels.

Node mode on real tmpfs mounts at the kubelet's paths, each pod's holder in its pod's real
memory cgroup (cgroup v1 here): each pod's default series stay within the budget, say the
pod once (its pod_uid and volume, not also the kubelet's path; its cgroup by the pod), write
no empty label and no pid; the exporter names --segments.top-k segments, not K a pod, leaks
first. A sidecar under churn: segments that live a second never get a series, while a leak
(a file a crashed engine left, last written long ago) is named by the very scrape that first
counts it orphan, and an old held segment with its holder's process name.
"""

import os
import re
import time
import uuid
from typing import Dict, Iterator, List, Optional

import pytest

from exporter.model.catalogue import BYTES_A_SERIES_BUDGET, SERIES_A_POD_BUDGET
from tests.conftest import Exporter, Peer, fallocate, mounted_tmpfs, needs_root, parse_exposition, remove_cgroup, \
    select, value

pytestmark = needs_root

MiB = 1 << 20
HOUR = 3600
V1_MEMORY = "/sys/fs/cgroup/memory"


def age(path: str, seconds: float = HOUR) -> None:
    """As if last written `seconds` ago."""
    then = time.time() - seconds
    os.utime(path, (then, then))


class Pod:
    """A pod emptyDir (a real tmpfs at the kubelet's path), its memory cgroup, and a holder in it."""

    def __init__(self, root: str, i: int):
        self.uid = str(uuid.uuid4())
        self.path = f"{root}/var/lib/kubelet/pods/{self.uid}/volumes/kubernetes.io~empty-dir/dshm"
        self.cgroup = os.path.join(V1_MEMORY, "kubepods", "burstable", f"pod{self.uid}")
        self.size = (i + 1) * MiB
        self.holder: Optional[Peer] = None


@pytest.fixture
def pods(tmp_path) -> Iterator[List[Pod]]:
    if not os.path.exists(os.path.join(V1_MEMORY, "memory.usage_in_bytes")):
        pytest.skip(f"no cgroup v1 memory controller at {V1_MEMORY}")
    made = [Pod(str(tmp_path), i) for i in range(3)]
    mounts, holders = [], []
    try:
        for pod in made:
            mounts.append(mounted_tmpfs("16m", path=pod.path))
            mounts[-1].__enter__()
            os.makedirs(pod.cgroup)
            with open(os.path.join(pod.cgroup, "memory.limit_in_bytes"), "w") as f:
                f.write(str(256 * MiB))
            # A leak of a crashed engine and a segment a live process maps, both long-lived.
            fallocate(os.path.join(pod.path, "psm_left"), pod.size)
            age(os.path.join(pod.path, "psm_left"))
            holder = pod.holder = Peer(pod.path, "mapped", "nccl-live", str(2 * pod.size))
            holders.append(holder)
            with open(os.path.join(pod.cgroup, "cgroup.procs"), "w") as f:
                f.write(str(holder.pid))
            age(os.path.join(pod.path, "nccl-live"))
        yield made
    finally:
        for holder in holders:
            holder.close()
        for cm in mounts:
            cm.__exit__(None, None, None)
        for pod in made:
            remove_cgroup(pod.cgroup)
        for parent in ("kubepods/burstable", "kubepods"):
            try:
                os.rmdir(os.path.join(V1_MEMORY, parent))
            except OSError:
                pass  # another test's pod cgroups are still in it


def lines_naming(text: str, uid: str) -> List[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#") and uid in line]


def test_node_mode_keeps_each_pod_within_its_budget_and_names_k_segments(pods: List[Pod]) -> None:
    # Every run reads every process: the leaks are called orphan within the test's seconds.
    with Exporter("--mode=node", "--no-collector.gpu", "--segments.full-scan-interval=0",
                  "--inventory-interval=300ms", "--segments.top-k=2") as exporter:
        s = exporter.wait_for(lambda s: all(value(s, "shmwatch_segments", pod_uid=p.uid, state="orphan") == 1
                                            for p in pods), timeout=20)
        text = exporter.scrape_text()
    assert '=""' not in text, "a label written empty"
    assert not re.search(r'[{,]pid="', text), "a pid as a label"
    for pod in pods:
        mine = lines_naming(text, pod.uid)
        assert 10 <= len(mine) <= SERIES_A_POD_BUDGET, (len(mine), mine)
        assert sum(map(len, mine)) / len(mine) <= BYTES_A_SERIES_BUDGET
        assert pod.path not in text and "kubernetes.io~empty-dir" not in text  # the pod and volume say it
        assert value(s, "shmwatch_mount_used_bytes", pod_uid=pod.uid, volume="dshm") == 3 * pod.size
        assert value(s, "shmwatch_cgroup_memory_limit_bytes", pod_uid=pod.uid) == 256 * MiB
        assert not [line for line in mine if "cgroup=" in line]  # the pod says which cgroup
    # K on the exporter, not K a pod: the two largest leaks, named, before any larger live segment.
    named = {(labels["pod_uid"], labels["name"], labels["state"]) for labels, _ in
             select(s, "shmwatch_top_segment_bytes")}
    assert named == {(pods[2].uid, "psm_left", "orphan"), (pods[1].uid, "psm_left", "orphan")}


def test_node_mode_names_an_old_segment_by_its_holders_process_name(pods: List[Pod]) -> None:
    with Exporter("--mode=node", "--no-collector.gpu", "--no-collector.cgroup", "--segments.full-scan-interval=0",
                  "--inventory-interval=300ms", "--segments.top-k=10") as exporter:
        s = exporter.wait_for(lambda s: len(select(s, "shmwatch_top_segment_bytes", name="nccl-live")) == 3,
                              timeout=20)
    for pod in pods:
        [(labels, size)] = select(s, "shmwatch_top_segment_bytes", pod_uid=pod.uid, name="nccl-live")
        assert labels["state"] == "linked" and labels["owner"] == pod.holder.comm and size == 2 * pod.size, labels


def orphans(samples: Dict, mount: str) -> float:
    return sum(v for labels, v in select(samples, "shmwatch_segments", mount=mount, state="orphan"))


def test_a_sidecar_never_names_a_segment_that_lives_seconds_and_names_a_leak_at_once(tmpfs: str) -> None:
    with Peer(tmpfs, "mapped", "nccl-old0001", str(MiB)) as holder, \
            Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", "--inventory-interval=300ms") as exporter:
        age(os.path.join(tmpfs, "nccl-old0001"))
        seen, counted = set(), 0.0
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < 4:  # 20 creates a second, each gone within a second
            path = os.path.join(tmpfs, f"sgl_shm_mm_{i:05d}")
            fallocate(path, MiB)
            if i >= 10:
                os.unlink(os.path.join(tmpfs, f"sgl_shm_mm_{i - 10:05d}"))
            s = exporter.scrape()
            seen |= {labels["name"] for labels, _ in select(s, "shmwatch_top_segment_bytes")}
            counted = max(counted, orphans(s, tmpfs))
            i += 1
            time.sleep(0.05)
        assert counted >= 5, "the churn's segments were counted as orphans"
        assert not [n for n in seen if n.startswith("sgl_shm_mm_")], seen
        # A crashed engine's leak: written long ago, nobody holds it. The scrape that first
        # counts one more orphan names it.
        for n in range(max(0, i - 10), i):
            os.unlink(os.path.join(tmpfs, f"sgl_shm_mm_{n:05d}"))
        before = exporter.wait_for(lambda s: orphans(s, tmpfs) == 0, timeout=10)
        assert orphans(before, tmpfs) == 0
        leak = os.path.join(tmpfs, "psm_crashed01")
        fallocate(leak, 2 * MiB)
        age(leak)
        s = exporter.wait_for(lambda s: orphans(s, tmpfs) == 1, timeout=10, interval=0.02)
        assert value(s, "shmwatch_top_segment_bytes", mount=tmpfs, name="psm_crashed01", state="orphan") == 2 * MiB
        assert value(s, "shmwatch_top_segment_bytes", mount=tmpfs, name="nccl-old0001", state="linked",
                     owner=holder.comm) == MiB
        assert len(parse_exposition(exporter.scrape_text())) < 120
