"""One model step: /metrics and `shmwatch check` report the same numbers from the same model,
and discovery is a job of its own."""
import json
import os
import shutil
import subprocess
import sys
import uuid

from exporter.collectors.discovery import MountDiscovery
from exporter.host.paths import Paths
from tests.conftest import REPO, Exporter, Peer, fallocate, mounted_tmpfs, needs_root, select, value

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


def pod_mount(root: str, uid: str, volume: str = "dshm") -> str:
    return f"{root}/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/{volume}"


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


def test_unreadable_mountinfo_keeps_the_last_mount_set(tmp_path):
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    uid = str(uuid.uuid4())
    point = pod_mount("", uid)
    (proc / "1" / "mountinfo").write_text(f"99 1 0:50 / {point} rw,nosuid - tmpfs tmpfs rw,size=16384k\n")
    from exporter.runtime.scheduler import Sampler

    discovery = MountDiscovery(Paths(procfs=str(proc)), ["/dev/shm"], node_mode=True)
    sampler = Sampler([discovery])
    published = []
    sampler.subscribe(published.append)
    sampler.runners["discovery"].run_once(full=True)
    assert point in published[0].result.mounts()
    shutil.rmtree(proc / "1")
    sampler.runners["discovery"].run_once(full=True)
    # An unreadable mountinfo fails the discovery run, and publishes no set.
    assert published[-1].result is None and "mountinfo" in published[-1].error
    assert point in discovery.current().mounts()  # the last good set stands
    assert point in sampler.inputs.mounts  # and every run is handed it


def test_check_judges_by_the_rules_thresholds():
    """`shmwatch check` and the alert rules say the same thing at the same numbers."""
    import re

    import yaml

    from exporter.check import thresholds as T
    with open(os.path.join(REPO, "deploy", "prometheus", "shmwatch-rules.yml")) as f:
        rules = {r["alert"]: r["expr"] for g in yaml.safe_load(f)["groups"] for r in g["rules"] if "alert" in r}
    expected = {
        "ShmUsageHigh": (">", T.SHM_USAGE_WARNING_RATIO), "ShmUsageCritical": (">", T.SHM_USAGE_CRITICAL_RATIO),
        "PodOomRiskHigh": (">", T.OOM_RISK_RATIO), "ShmSizeExceedsMemoryLimit": (">", T.SHM_OOM_PROJECTION_RATIO),
        "HostMemoryLow": ("<", T.HOST_MEMORY_AVAILABLE_LOW_RATIO), "SysvSegmentsNearLimit": (">", T.SYSV_NEAR_LIMIT_RATIO),
        "SysvBytesNearLimit": (">", T.SYSV_NEAR_LIMIT_RATIO), "GpuMemoryNearlyFull": (">", T.GPU_MEMORY_FULL_RATIO),
        "ShmDockerDefaultSize": ("<=", T.DOCKER_DEFAULT_SHM_BYTES),
    }
    for alert, (op, number) in expected.items():
        found = [float(x) for x in re.findall(re.escape(op) + r"\s*([0-9.]+)", rules[alert])]
        assert number in found, f"{alert}: rule says {rules[alert]!r}, exporter/check/thresholds.py says {op} {number}"


def test_a_failing_subscriber_does_not_stop_a_source():
    """An exception in one subscriber (a bug in the watcher, say) must not end the source's
    thread, nor keep the other subscribers from the observation."""
    from exporter.collectors.source import Source
    from exporter.runtime.scheduler import Sampler

    class Counter(Source):
        name = "counter"
        runs = 0

        def collect(self, run):
            Counter.runs += 1
            return Counter.runs

    seen = []
    sampler = Sampler([Counter()], poll_interval=0.05)

    def broken(obs):
        raise RuntimeError("subscriber bug")

    sampler.subscribe(broken)
    sampler.subscribe(seen.append)
    sampler.start()
    try:
        import time
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        sampler.stop()
    assert len(seen) >= 3 and all(o.success for o in seen)


def test_effective_size_is_absent_while_the_memory_limit_is_unknown(tmp_path):
    """The cgroup collector on but failing, and no --memory.limit-bytes: the tmpfs size alone
    would overstate what can be filled, so no effective size is exported."""
    from exporter.collectors.cgroup import CgroupCollector
    from exporter.collectors.shm_mount import ShmMountCollector
    from tests.helpers import registry_for

    shm = "/dev/shm"  # a mount point (only read): a directory that is none is not measured
    broken = CgroupCollector(Paths(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys")))
    reg, _ = registry_for(ShmMountCollector(Paths()), broken, mounts=[str(shm)])
    assert reg.get_sample_value("shmwatch_collector_success", {"collector": "cgroup"}) == 0
    assert reg.get_sample_value("shmwatch_mount_size_bytes", {"mount": str(shm)}) > 0
    assert reg.get_sample_value("shmwatch_mount_effective_size_bytes", {"mount": str(shm)}) is None
    reg, _ = registry_for(ShmMountCollector(Paths()), broken, memory_limit=1 << 20, mounts=[str(shm)])
    assert reg.get_sample_value("shmwatch_mount_effective_size_bytes", {"mount": str(shm)}) == 1 << 20


def test_the_model_is_rebuilt_only_when_its_version_moved(tmp_path):
    """The version moves with every accepted observation and every change to the state store
    (nobody is called back); current() builds the model again only then."""
    from exporter.collectors.shm_mount import ShmMountCollector
    from tests.helpers import registry_for

    shm = tmp_path / "shm"
    shm.mkdir()
    _, harness = registry_for(ShmMountCollector(Paths()), mounts=[str(shm)])
    step = harness.step
    model, version = step.current(), step.version()
    assert step.current() is model and step.version() == version  # nothing happened
    harness.sampler.runners["shm_mount"].run_once(full=False)
    assert step.version() != version
    rebuilt = step.current()
    assert rebuilt is not model and step.current() is rebuilt
    version = step.version()
    harness.state.count_event(str(shm), "nccl", "created")  # the watcher, say
    assert step.version() != version
    assert step.current().states.event_rows == {str(shm): (("nccl", "created", 1),)}


def test_the_kill_log_is_complete_only_when_read_and_nothing_was_lost():
    """Runs are handed whether the kernel log counts every OOM kill (node mode's cgroups
    stretch only then): from the oom source's last run."""
    from exporter.model.types import Observation, OomReports
    from exporter.runtime.inputs import RunInputs

    inputs = RunInputs()
    assert not inputs.make({}).kill_log_complete  # never read
    inputs.on_observation(Observation("oom", OomReports((), 0), None, 0.0))
    assert inputs.make({}).kill_log_complete
    inputs.on_observation(Observation("oom", OomReports((), 3), None, 0.0))  # records overwritten
    assert not inputs.make({}).kill_log_complete
    inputs.on_observation(Observation("oom", OomReports((), 0), None, 0.0))
    inputs.on_observation(Observation("oom", None, "PermissionError: /dev/kmsg", 0.0))
    assert not inputs.make({}).kill_log_complete


def test_peaks_are_reset_only_for_a_proven_new_mount():
    """A passing statvfs error (the same mount), or a mount table that could not be read,
    keeps the peak and high-water mark; a mount gone, or another instance, starts them afresh."""
    from exporter.model.state import StateStore
    from exporter.model.types import MountInstance, MountUsage

    store = StateStore()

    def poll(used=0, instance=None, error=None):
        store.record_polled([MountUsage("/m", "tmpfs", "shm", True, error=error, used_bytes=used,
                                        instance=instance)])
        high = store.snapshot().max_used.get("/m")
        return high and high.used_bytes

    first = MountInstance(device="0:42", mount_id=7, unique_id=1)
    assert poll(900, first) == 900
    assert poll(error="Input/output error", instance=first) == 900  # still this mount
    assert poll(100) == 900  # which instance unknown: proves nothing
    assert poll(100, first) == 900
    assert poll(100, MountInstance(device="0:42", mount_id=7, unique_id=2)) == 100  # another instance at the path
    assert poll(error="not a mount point") is None  # gone
