"""Every recording rule's value on synthetic series, computed by hand from the inputs.

One builder per rule family (change a family's inputs there): the GPU latch, the
kube-prometheus joins, node mode's pod-name joins and the shm size recommendation. Each set
operator's sides are covered (Side), and the inputs a rule must ignore are present beside
the ones it reads (another job, another endpoint, another resource, another pod).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from tests.rules.labels import CACHE, CGROUP, GPU, NODE, SHM, SIDECAR, GiB, Labels, MiB
from tests.rules.scenario import Equals, Scenario, Series, Side, const, equals, merge, only, selector

LATCH = "shmwatch:gpus_seen"
HOST = {k: NODE[k] for k in ("instance", "job")}


def gpu(index: int, values: str) -> Series:
    labels = {**GPU, "gpu": str(index), "uuid": f"GPU-{index}", "name": "H100", "driver_version": "550"}
    return {selector("shmwatch_gpu_info", labels): values}


def collector(values: str, name: str = "gpu") -> Series:
    return {selector("shmwatch_collector_success", {**NODE, "collector": name}): values}


def latch(at: str, value: float = 0) -> Equals:
    return equals(LATCH, at, (LATCH, HOST, value)) if value else equals(LATCH, at)


def gpus_seen() -> Tuple[Scenario, ...]:
    s = "shmwatch:gpus_seen: "
    nvml_fails_at_20 = collector("1x19 0x400")
    return (
        # Two GPUs, one from minute 10, none from 20 (NVML fails): the count now wins over the
        # latch while there is one, and the latch keeps the last count after.
        Scenario(
            name=s + "2 GPUs, then 1, then NVML failing",
            series=merge(gpu(0, "1x19 stale"), gpu(1, "1x9 stale"), nvml_fails_at_20),
            checks=(latch("5m", 2), latch("10m", 1), latch("30m", 1)),
            covers=(
                Side(rule=LATCH, index=0, side="both"),
                Side(rule=LATCH, index=0, side="right"),
                Side(rule=LATCH, index=1, side="both"),
            ),
        ),
        Scenario(
            name=s + "1 GPU, then 2, then NVML failing",
            series=merge(gpu(0, "1x19 stale"), gpu(1, "_x10 1x9 stale"), nvml_fails_at_20),
            checks=(latch("15m", 2), latch("30m", 2)),
        ),
        # An exporter that reports GPUs but no success series (a version before it had one).
        Scenario(
            name=s + "GPUs, no success series",
            series=gpu(0, const(1)),
            checks=(latch("5m", 1),),
            covers=(Side(rule=LATCH, index=0, side="left"),),
        ),
        # --no-collector.gpu after a restart: the success series goes, and the latch with it.
        Scenario(
            name=s + "the GPU collector switched off",
            series=merge(gpu(0, "1x9 stale"), collector("1x9 stale"), collector(const(1), "segments")),
            checks=(latch("20m"),),
            covers=(Side(rule=LATCH, index=1, side="left"),),
        ),
        Scenario(
            name=s + "a CPU node",
            series=collector(const(0)),
            checks=(latch("20m"),),
            covers=(Side(rule=LATCH, index=1, side="right"),),
        ),
        # The success series gone for 40 minutes (a Prometheus restart): the latch comes back;
        # gone for 90 minutes, it has lapsed.
        Scenario(
            name=s + "a 40-minute gap",
            series=merge(gpu(0, "1x9 stale"), collector("1x9 stale _x40 0x400")),
            checks=(latch("55m", 1),),
        ),
        Scenario(
            name=s + "a 90-minute gap",
            series=merge(gpu(0, "1x9 stale"), collector("1x9 stale _x90 0x400")),
            checks=(latch("105m"),),
        ),
    )


CADVISOR = {"job": "kubelet", "metrics_path": "/metrics/cadvisor", "instance": "10.0.3.1:10250"}
KSM = {"job": "kube-state-metrics", "instance": "10.0.9.9:8080"}


def cadvisor(namespace: str, pod: str, container: str, image: str, mib: float, **other: str) -> Series:
    labels = {**CADVISOR, "namespace": namespace, "pod": pod, "container": container, "image": image, **other}
    return {selector("container_memory_working_set_bytes", labels): const(mib * MiB)}


def ksm(namespace: str, pod: str, container: str, memory_mib: float = 0, cpu: float = 0, **other: str) -> Series:
    base = {**KSM, "namespace": namespace, "pod": pod, "container": container, **other}
    series = {selector("kube_pod_container_info", base): const(1)}
    if memory_mib:
        series[selector("kube_pod_container_resource_limits", {**base, "resource": "memory", "unit": "byte"})] = const(
            memory_mib * MiB
        )
    if cpu:
        series[selector("kube_pod_container_resource_limits", {**base, "resource": "cpu", "unit": "core"})] = const(cpu)
    return series


def sidecar_mount(
    namespace: str, pod: str, mount: str, used_mib: float, size_mib: float, job: str = "ml/shmwatch"
) -> Series:
    labels = {"job": job, "instance": "10.0.0.7:9841", "namespace": namespace, "pod": pod, "mount": mount}
    return {
        selector("shmwatch_mount_used_bytes", labels): const(used_mib * MiB),
        selector("shmwatch_mount_size_bytes", labels): const(size_mib * MiB),
    }


def daemonset_pod_series() -> Series:
    """The node-mode DaemonSet (monitoring/shmwatch-node-x7k2p, 40 MiB of a 256 MiB limit),
    scraped by a PodMonitor, which gives every series its own pod's namespace and pod: two
    pods' emptyDirs (pod_uid and volume, no `mount`) and a runtime's sandbox shm
    (container_id). None is the DaemonSet pod's own: no projection of it may come of them."""
    labels = {"job": "monitoring/shmwatch-node", "instance": "10.0.3.1:9841", "namespace": "monitoring",
              "pod": "shmwatch-node-x7k2p"}
    mounts = ({"pod_uid": "u1", "volume": "dshm"}, {"pod_uid": "u2", "volume": "dshm"}, {"container_id": "c0ffee"})
    series = merge(cadvisor("monitoring", "shmwatch-node-x7k2p", "shmwatch", "s", 40),
                   ksm("monitoring", "shmwatch-node-x7k2p", "shmwatch", memory_mib=256))
    for used, size, mount in zip((900, 10, 1), (2048, 64, 64), mounts):
        series[selector("shmwatch_mount_used_bytes", {**labels, **mount})] = const(used * MiB)
        series[selector("shmwatch_mount_size_bytes", {**labels, **mount})] = const(size * MiB)
    return series


def kube_world() -> Series:
    """vllm-0: vllm (300 MiB of 512) and the shmwatch sidecar (20 of 96), /dev/shm 200 of
    1024 MiB used and a cache tmpfs 50 of 100; the pod-level series (container="") and the
    pause container (image="") are not containers; the kubelet's /metrics/resource and a
    federated copy (another job) say other numbers; CPU limits are not memory. open-0: its
    container b has no memory limit (a CPU one), so the pod has no limit. tiny-0: shm used
    (100 MiB) above the pod's working set (10 MiB; charged to another cgroup)."""
    return merge(
        cadvisor("ml", "vllm-0", "vllm", "v", 300),
        cadvisor("ml", "vllm-0", "shmwatch", "s", 20),
        cadvisor("ml", "vllm-0", "", "", 321),
        cadvisor("ml", "vllm-0", "POD", "", 1),
        cadvisor("ml", "vllm-0", "", "registry.k8s.io/pause:3.9", 1),  # CRI-O's pause container
        cadvisor("ml", "vllm-0", "vllm", "v", 999, metrics_path="/metrics/resource"),
        cadvisor("ml", "vllm-0", "vllm", "v", 777, job="federate"),
        ksm("ml", "vllm-0", "vllm", memory_mib=512, cpu=2),
        ksm("ml", "vllm-0", "shmwatch", memory_mib=96),
        ksm("ml", "vllm-0", "vllm", memory_mib=4096, job="federate"),
        sidecar_mount("ml", "vllm-0", "/dev/shm", 200, 1024),
        sidecar_mount("ml", "vllm-0", "/mnt/cache", 50, 100),
        sidecar_mount("ml", "vllm-0", "/dev/shm", 900, 2048, job="federate"),
        # The same sidecar scraped twice (a PodMonitor and a ServiceMonitor): the two scrapes
        # disagree (a second apart; a size read before a resize); the larger of each counts.
        sidecar_mount("ml", "vllm-0", "/dev/shm", 210, 1000, job="ml/shmwatch-svc"),
        sidecar_mount("ml", "vllm-0", "/mnt/cache", 40, 100, job="ml/shmwatch-svc"),
        cadvisor("ml", "open-0", "a", "a", 10),
        ksm("ml", "open-0", "a", memory_mib=64),
        ksm("ml", "open-0", "b", cpu=1),
        ksm("ml", "open-0", "b", memory_mib=64, job="federate"),
        sidecar_mount("ml", "open-0", "/dev/shm", 1, 64),
        cadvisor("ml", "tiny-0", "t", "t", 10),
        ksm("ml", "tiny-0", "t", memory_mib=64),
        sidecar_mount("ml", "tiny-0", "/dev/shm", 100, 200),
        daemonset_pod_series(),
    )


def kube() -> Tuple[Scenario, ...]:
    ws, limit = "shmwatch:kube_pod_memory_working_set_bytes", "shmwatch:kube_pod_memory_limit_bytes"
    risk, projection = "shmwatch:kube_pod_oom_risk_ratio", "shmwatch:kube_pod_shm_oom_projection_ratio"
    vllm, open0, tiny = ({"namespace": "ml", "pod": p} for p in ("vllm-0", "open-0", "tiny-0"))
    ds = {"namespace": "monitoring", "pod": "shmwatch-node-x7k2p"}
    return (
        Scenario(
            name="kube-prometheus joins",
            series=kube_world(),
            checks=(
                equals(ws, "5m", (ws, vllm, 320 * MiB), (ws, open0, 10 * MiB), (ws, tiny, 10 * MiB),
                       (ws, ds, 40 * MiB)),
                equals(limit, "5m", (limit, vllm, 608 * MiB), (limit, tiny, 64 * MiB), (limit, ds, 256 * MiB)),
                equals(risk, "5m", (risk, vllm, 320 / 608), (risk, tiny, 10 / 64), (risk, ds, 40 / 256)),
                equals(
                    projection,
                    "5m",
                    # The larger of the two scrapes' used bytes.
                    (projection, {**vllm, "mount": "/dev/shm"}, (320 - 210 + 1024) * MiB / (608 * MiB)),
                    (projection, {**vllm, "mount": "/mnt/cache"}, (320 - 50 + 100) * MiB / (608 * MiB)),
                    # working set below the shm used: nothing but the mount's size counts.
                    (projection, {**tiny, "mount": "/dev/shm"}, (0 + 200 * MiB) / (64 * MiB)),
                    # None of the DaemonSet pod's (daemonset_pod_series: other pods' mounts).
                ),
            ),
            covers=(Side(rule=limit, index=0, side="left"), Side(rule=limit, index=0, side="both")),
        ),
    )


PODS = {"u1": ("llm", "sglang-1"), "u2": ("batch", "trainer-0")}


def kube_pod_info() -> Series:
    """kube-state-metrics (two replicas) names pods u1 and u2; a pod without a uid is left out."""
    series: Series = {}
    for replica in ("10.0.9.9:8080", "10.0.9.8:8080"):
        for uid, (namespace, pod) in PODS.items():
            labels = {
                "job": "kube-state-metrics",
                "instance": replica,
                "namespace": namespace,
                "pod": pod,
                "uid": uid,
                "node": "a",
            }
            series[selector("kube_pod_info", labels)] = const(1)
    series[selector("kube_pod_info", {"job": "kube-state-metrics", "namespace": "x", "pod": "no-uid"})] = const(1)
    return series


def pod_series(uid: str, volume: str = "dshm") -> Labels:
    return {**NODE, "pod_uid": uid, "volume": volume}


def named(labels: Labels, uid: str) -> Dict[str, str]:
    """A pod's series as the joins label it: namespace and pod are the workload's."""
    namespace, pod = PODS[uid]
    return {**labels, "namespace": namespace, "pod": pod}


@dataclass(frozen=True)
class NodeMount:
    labels: Labels
    usage_ratio: float  # used / size: the size follows
    used_bytes: float
    projection_ratio: float

    @property
    def size_bytes(self) -> float:
        size = self.used_bytes / self.usage_ratio
        assert self.used_bytes / size == self.usage_ratio
        return size


# Node mode's mounts. Pod u3 is one kube-state-metrics does not name; the host's /dev/shm
# has no pod_uid.
MOUNTS = {
    "u1 dshm": NodeMount(labels=pod_series("u1"), usage_ratio=0.25, used_bytes=1000, projection_ratio=1.5),
    "u1 cache": NodeMount(labels=pod_series("u1", "cache"), usage_ratio=0.5, used_bytes=2000, projection_ratio=2.5),
    "u2 dshm": NodeMount(labels=pod_series("u2"), usage_ratio=0.75, used_bytes=3000, projection_ratio=3.5),
    "u3 dshm": NodeMount(labels=pod_series("u3"), usage_ratio=0.125, used_bytes=4000, projection_ratio=4.5),
    "host": NodeMount(labels={**NODE, "mount": "/dev/shm"}, usage_ratio=0.3125, used_bytes=5000, projection_ratio=5.5),
}
# By pod_uid ("": the host's cgroup): working set / limit, of a limit of LIMIT.
OOM_RISK = {"u1": 0.625, "u2": 0.875, "u3": 0.0625, "": 0.375}
LIMIT = 8000


def cgroup_of(uid: str) -> Labels:
    """A pod's cgroup is named by its pod_uid; another cgroup by its path."""
    return {**NODE, "pod_uid": uid} if uid else {**NODE, "cgroup": "/system.slice"}


def segment_kinds(used: float) -> Dict[Tuple[str, str], float]:
    """A mount's segment bytes by (class, state): three kinds, all different."""
    return {("nccl", "orphan"): used / 10, ("torch", "orphan"): used / 10 + 1, ("nccl", "linked"): used / 10 + 2}


def node_inputs() -> Series:
    series: Series = {}
    for mount in MOUNTS.values():
        labels = mount.labels
        series[selector("shmwatch_mount_size_bytes", labels)] = const(mount.size_bytes)
        series[selector("shmwatch_mount_used_bytes", labels)] = const(mount.used_bytes)
        for (cls, state), value in segment_kinds(mount.used_bytes).items():
            series[selector("shmwatch_segment_bytes", {**labels, "class": cls, "state": state})] = const(value)
        projection_labels = {**labels, **cgroup_of(labels.get("pod_uid", ""))}
        series[selector("shmwatch_shm_oom_projection_ratio", projection_labels)] = const(mount.projection_ratio)
    for uid, risk in OOM_RISK.items():
        limit = {**cgroup_of(uid), "limit_from": "pod" if uid else "self"}
        series[selector("shmwatch_cgroup_memory_working_set_bytes", cgroup_of(uid))] = const(risk * LIMIT)
        series[selector("shmwatch_cgroup_memory_limit_bytes", limit)] = const(LIMIT)
    return merge(series, canary_segments(), kube_pod_info())


CANARY = {"instance": "10.0.1.9:9842", "job": "shmwatch-node-canary", "namespace": "shmwatch", "pod": "canary-a"}
CANARY_DELTA = {("nccl", "orphan"): 50, ("torch", "orphan"): -50, ("nccl", "linked"): 0}


def canary_segments() -> Series:
    """A second DaemonSet (a canary) on the node reports pod u1's first mount too, a scan
    apart: more of one kind, less of another, the same of the third."""
    labels = {**MOUNTS["u1 dshm"].labels, **CANARY}
    return {
        selector("shmwatch_segment_bytes", {**labels, "class": cls, "state": state}): const(
            value + CANARY_DELTA[(cls, state)]
        )
        for (cls, state), value in segment_kinds(MOUNTS["u1 dshm"].used_bytes).items()
    }


def node() -> Tuple[Scenario, ...]:
    info = "shmwatch:pod_info"
    projection = "shmwatch:pod_shm_oom_projection_ratio"
    named_mounts = {key: MOUNTS[key] for key in ("u1 dshm", "u1 cache", "u2 dshm")}

    def uid(key: str) -> str:
        return key.split()[0]

    def per_mount(record: str, value: Callable[[NodeMount], float]) -> Equals:
        return equals(record, "5m", *((record, named(m.labels, uid(k)), value(m)) for k, m in named_mounts.items()))

    segments = []
    for key, mount in named_mounts.items():
        kept = {k: v for k, v in mount.labels.items() if k in ("pod_uid", "volume")}
        for (cls, state), value in segment_kinds(mount.used_bytes).items():
            labels = named({**kept, "class": cls, "state": state}, uid(key))
            # Two exporters' reports of the same segments: the larger, not their sum.
            seen_twice = max(value, value + CANARY_DELTA[(cls, state)]) if key == "u1 dshm" else value
            segments.append(("shmwatch:pod_segment_bytes", labels, seen_twice))
    risks = (("shmwatch:pod_oom_risk_ratio", named(cgroup_of(u), u), OOM_RISK[u]) for u in PODS)
    projections = (
        (projection, named({**m.labels, **cgroup_of(uid(k))}, uid(k)), m.projection_ratio)
        for k, m in named_mounts.items()
    )
    return (
        Scenario(
            name="node mode: pods named by kube_pod_info",
            series=node_inputs(),
            checks=(
                equals(
                    info, "5m", *((info, {"pod_uid": u, "namespace": ns, "pod": p}, 1) for u, (ns, p) in PODS.items())
                ),
                per_mount("shmwatch:pod_mount_usage_ratio", lambda m: m.usage_ratio),
                per_mount("shmwatch:pod_mount_used_bytes", lambda m: m.used_bytes),
                equals("shmwatch:pod_segment_bytes", "5m", *segments),
                equals("shmwatch:pod_oom_risk_ratio", "5m", *risks),
                equals(projection, "5m", *projections),
            ),
        ),
    )


PEAK = "shmwatch:mount_observed_peak_bytes"
SIZE = "shmwatch:mount_recommended_size_bytes"
NEEDED = "shmwatch:mount_recommended_memory_limit_bytes"


def peak_series(values: str, labels: Labels = SHM) -> Series:
    return {selector("shmwatch_mount_peak_used_bytes", labels): values}


@dataclass(frozen=True)
class Rounding:
    peak: float
    size: float  # what the recommendation must be


def recommend() -> Tuple[Scenario, ...]:
    s = "recommendation: "
    ten, two = 10 * GiB, 2 * GiB
    # x 1.25: 13086228480 (12.1875 GiB) -> 13 GiB; 41 MiB -> 51.25 -> 52 MiB; 760 MiB ->
    # 950 MiB (under 1 GiB: whole MiB); 900 MiB -> 1125 MiB -> 2 GiB; exactly 1 GiB stays
    # 1 GiB; nothing -> 1 MiB.
    peaks = {
        "/a": Rounding(peak=10468982784, size=13 * GiB),
        "/b": Rounding(peak=41 * MiB, size=52 * MiB),
        "/c": Rounding(peak=760 * MiB, size=950 * MiB),
        "/d": Rounding(peak=900 * MiB, size=2 * GiB),
        "/e": Rounding(peak=858993459.2, size=GiB),
        "/f": Rounding(peak=0, size=MiB),
    }
    sized = merge(*(peak_series(const(r.peak), only(SHM, mount=m)) for m, r in peaks.items()))
    return (
        # A 10 GiB peak in the first hour, 2 GiB since: it counts for 7 days, not after.
        Scenario(
            name=s + "a peak a week ago",
            series=peak_series(f"{ten} {two}x200"),
            checks=(
                equals(PEAK, "167h", (PEAK, SHM, ten)),
                equals(PEAK, "169h", (PEAK, SHM, two)),
                equals(SIZE, "167h", (SIZE, SHM, 13 * GiB)),
                equals(SIZE, "169h", (SIZE, SHM, 3 * GiB)),
            ),
            interval="1h",
            evaluation="1h",
        ),
        Scenario(
            name=s + "rounding",
            series=sized,
            checks=(equals(SIZE, "5m", *((SIZE, only(SHM, mount=m), r.size) for m, r in peaks.items())),),
            covers=(
                Side(rule=SIZE, index=0, side="both"),
                Side(rule=SIZE, index=0, side="left"),
                Side(rule=SIZE, index=1, side="both"),
                Side(rule=SIZE, index=1, side="right"),
            ),
        ),
        Scenario(
            name=s + "the memory limit it needs",
            series=merge(
                peak_series(const(8 * GiB)),
                peak_series(const(GiB), CACHE),
                {
                    selector("shmwatch_mount_used_bytes", SHM): const(GiB),
                    selector("shmwatch_mount_used_bytes", CACHE): const(4 * GiB),
                    selector("shmwatch_cgroup_memory_working_set_bytes", CGROUP): const(3 * GiB + 1000),
                    selector("shmwatch_cgroup_memory_usage_bytes", CGROUP): const(5 * GiB),
                },
                node_recommendation(),
            ),
            checks=(
                # 10 GiB + (3 GiB + 1000 - 1 GiB), up to a whole MiB; 2 GiB + nothing (4 GiB used
                # is over the working set); node mode: 13 GiB + (5 - 1) GiB for u1, 2 GiB +
                # (3 - 0) GiB for u2.
                equals(
                    NEEDED,
                    "5m",
                    (NEEDED, SHM, 12 * GiB + MiB),
                    (NEEDED, CACHE, 2 * GiB),
                    (NEEDED, pod_series("u1"), 17 * GiB),
                    (NEEDED, pod_series("u2"), 5 * GiB),
                ),
            ),
        ),
    )


def node_recommendation() -> Series:
    series: Series = {}
    for uid, peak, used, working_set in (("u1", 10 * GiB, GiB, 5 * GiB), ("u2", GiB, 0, 3 * GiB)):
        series[selector("shmwatch_mount_peak_used_bytes", pod_series(uid))] = const(peak)
        series[selector("shmwatch_mount_used_bytes", pod_series(uid))] = const(used)
        series[selector("shmwatch_cgroup_memory_working_set_bytes", cgroup_of(uid))] = const(working_set)
    return series


def ratios() -> Tuple[Scenario, ...]:
    """The ratios left to Prometheus: used / size per mount, working set / limit per cgroup,
    for a sidecar's mounts and cgroup and for node mode's pods (each its own), none where a
    cgroup has no limit."""
    usage, risk = "shmwatch:mount_usage_ratio", "shmwatch:oom_risk_ratio"
    estimate = {**SIDECAR, "cgroup": "estimate:workload"}
    pods = {uid: MOUNTS[f"{uid} dshm"] for uid in ("u1", "u2")}
    series = merge(
        {
            selector("shmwatch_mount_used_bytes", SHM): const(300),
            selector("shmwatch_mount_size_bytes", SHM): const(1200),
            selector("shmwatch_mount_used_bytes", CACHE): const(50),
            selector("shmwatch_mount_size_bytes", CACHE): const(400),
            selector("shmwatch_cgroup_memory_working_set_bytes", CGROUP): const(600),
            selector("shmwatch_cgroup_memory_limit_bytes", {**CGROUP, "limit_from": "ancestor"}): const(800),
            selector("shmwatch_cgroup_memory_working_set_bytes", estimate): const(100),
        },
        *(
            {
                selector("shmwatch_mount_used_bytes", m.labels): const(m.used_bytes),
                selector("shmwatch_mount_size_bytes", m.labels): const(m.size_bytes),
                selector("shmwatch_cgroup_memory_working_set_bytes", cgroup_of(uid)): const(OOM_RISK[uid] * LIMIT),
                selector("shmwatch_cgroup_memory_limit_bytes", {**cgroup_of(uid), "limit_from": "pod"}): const(LIMIT),
            }
            for uid, m in pods.items()
        ),
    )
    mounts = [(usage, SHM, 300 / 1200), (usage, CACHE, 50 / 400)]
    mounts += [(usage, m.labels, m.usage_ratio) for m in pods.values()]
    cgroups = [(risk, CGROUP, 600 / 800)] + [(risk, cgroup_of(uid), OOM_RISK[uid]) for uid in pods]
    return (
        Scenario(
            name="ratios: usage per mount, OOM risk per cgroup",
            series=series,
            checks=(equals(usage, "5m", *mounts), equals(risk, "5m", *cgroups)),
        ),
    )


def scenarios() -> Tuple[Scenario, ...]:
    return ratios() + gpus_seen() + kube() + node() + recommend()
