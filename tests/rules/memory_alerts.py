"""The memory, SysV, GPU, exporter and recommendation alerts: for each, a builder of its
input series (change the inputs there), a case that fires with its exact value, quiet cases
at the threshold and for what it must ignore, and each side of every and/or/unless."""

from __future__ import annotations

from typing import Tuple

from tests.rules.labels import (
    CGROUP,
    GPU,
    NODE,
    POD_CGROUP,
    SHM,
    SIDECAR,
    SYSV_HOST,
    SYSV_POD,
    GiB,
    Labels,
    MiB,
)
from tests.rules.scenario import Scenario, Series, Side, const, merge, only, selector
from tests.rules.shm_alerts import case, gauge


def shmem_under_high(
    shmem: float,
    high: float = 0,
    limit: float = 0,
    events: str = "0+3x400",
    labels: Labels = CGROUP,
    event: str = "high",
) -> Series:
    """PodThrottledAtMemoryHigh's inputs: shm charged to the cgroup, its memory.high and its
    limit (0: none), and memory.events' counter of `event` (in promtool's notation)."""
    series = (
        {selector("shmwatch_cgroup_memory_shmem_bytes", labels): const(shmem)}
        if shmem
        else {}
    )
    if high:
        series[selector("shmwatch_cgroup_memory_high_bytes", labels)] = const(high)
    if limit:
        series[
            selector(
                "shmwatch_cgroup_memory_limit_bytes", {**labels, "limit_from": "self"}
            )
        ] = const(limit)
    if events:
        series[
            selector("shmwatch_cgroup_memory_events_total", {**labels, "event": event})
        ] = events
    return series


def throttled() -> Tuple[Scenario, ...]:
    a = "PodThrottledAtMemoryHigh"
    quiet_a_while = "0x400"
    return (
        # memory.high and a limit both: memory.high is what throttles, so shm is held to it.
        case(
            a,
            "memory.high and a limit: 300 of 400 (the limit would say 300 of 1000)",
            shmem_under_high(300, high=400, limit=1000),
            (CGROUP, 300 / 400),
            covers=(
                Side(rule=a, index=0, side="both"),
                Side(rule=a, index=1, side="both"),
            ),
        ),
        case(
            a,
            "memory.high and a limit: 300 of 1000 (the limit would say 300 of 400)",
            shmem_under_high(300, high=1000, limit=400),
        ),
        case(
            a,
            "memory.high only: 204 of 400",
            shmem_under_high(204, high=400),
            (CGROUP, 204 / 400),
            covers=(Side(rule=a, index=0, side="left"),),
        ),
        # A pod's cgroup (node mode) has no memory.high of its own: its limit.
        case(
            a,
            "a pod's cgroup, limit only: 300 of 500",
            shmem_under_high(300, limit=500, labels=POD_CGROUP),
            (POD_CGROUP, 300 / 500),
            covers=(Side(rule=a, index=0, side="right"),),
        ),
        case(a, "half of memory.high", shmem_under_high(200, high=400)),
        case(
            a,
            "not throttled: memory.events' high flat",
            shmem_under_high(300, high=400, events=quiet_a_while),
        ),
        case(
            a,
            "throttled, no shm series",
            shmem_under_high(0, high=400),
            covers=(Side(rule=a, index=1, side="right"),),
        ),
        case(
            a,
            "shm over memory.high, no memory.events",
            shmem_under_high(300, high=400, events=""),
            covers=(Side(rule=a, index=1, side="left"),),
        ),
        case(
            a,
            "at memory.max, not memory.high",
            shmem_under_high(300, high=400, event="max"),
        ),
        # One throttling at minute 14: in the last 10 minutes from 14 to 23, so pending from 14 and firing at 20.
        case(
            a,
            "throttled once, 6 minutes ago",
            shmem_under_high(300, high=400, events="0x13 1x400"),
            (CGROUP, 300 / 400),
            at="20m",
        ),
        case(
            a,
            "throttled once, 15 minutes ago",
            shmem_under_high(300, high=400, events="0x4 1x400"),
            at="20m",
        ),
        # Node mode: two pods on one node, each its own (pod u2, shm over half of its limit but
        # never throttled, is not pod u1, throttled; nor is u2's larger limit u1's).
        case(
            a,
            "node mode, two pods, one throttled",
            merge(
                shmem_under_high(300, limit=500, labels=POD_CGROUP),
                shmem_under_high(
                    1200,
                    limit=2000,
                    events=quiet_a_while,
                    labels=only(POD_CGROUP, pod_uid="u2"),
                ),
            ),
            (POD_CGROUP, 300 / 500),
        ),
        # Each cgroup's own memory.high, else its own limit, matched by the cgroup's path or its
        # pod: a pod's cgroup with a memory.high of its own is held to it (not its limit), and a
        # host cgroup with a limit only to its limit.
        case(
            a,
            "a pod's cgroup with memory.high: 300 of 400 (the limit would say 300 of 1000)",
            shmem_under_high(300, high=400, limit=1000, labels=POD_CGROUP),
            (POD_CGROUP, 300 / 400),
        ),
        case(
            a,
            "a host cgroup, limit only: 300 of 500",
            shmem_under_high(300, limit=500),
            (CGROUP, 300 / 500),
        ),
    )


def working_set(
    used: float, limit: float = 0, labels: Labels = CGROUP, limit_from: str = "self"
) -> Series:
    """A cgroup's working set and its limit (0: none)."""
    series = {selector("shmwatch_cgroup_memory_working_set_bytes", labels): const(used)}
    if limit:
        series[
            selector(
                "shmwatch_cgroup_memory_limit_bytes",
                {**labels, "limit_from": limit_from},
            )
        ] = const(limit)
    return series


def oom() -> Tuple[Scenario, ...]:
    kills = "shmwatch_cgroup_oom_kills_total"
    risk, projection = "PodOomRiskHigh", "ShmSizeExceedsMemoryLimit"
    one_kill_at_21 = {selector(kills, CGROUP): "2x20 3x400"}
    pod_u2 = only(POD_CGROUP, pod_uid="u2")
    return (
        case(risk, "over 90 %", working_set(91, 100), (CGROUP, 91 / 100)),
        case(risk, "at 90 %", working_set(90, 100)),
        case(risk, "no limit", working_set(91)),
        case(
            risk,
            "an estimate, against --memory.limit-bytes",
            working_set(
                95, 100, {**SIDECAR, "cgroup": "estimate:workload"}, limit_from="flag"
            ),
            ({**SIDECAR, "cgroup": "estimate:workload"}, 95 / 100),
        ),
        # Node mode: two pods on one node, each against its own limit.
        case(
            risk,
            "node mode, two pods, one near its limit",
            merge(
                working_set(91, 100, POD_CGROUP),
                working_set(91, 1000, pod_u2, limit_from="pod"),
            ),
            (POD_CGROUP, 91 / 100),
        ),
        case(
            projection,
            "over the limit",
            gauge("shmwatch_shm_oom_projection_ratio", 1.01, {**CGROUP, **SHM}),
            ({**CGROUP, **SHM}, 1.01),
        ),
        case(
            projection,
            "at the limit",
            gauge("shmwatch_shm_oom_projection_ratio", 1, {**CGROUP, **SHM}),
        ),
        # One kill at minute 21: increase over the 10 minutes to 25 and to 28 is 1, to 31 is 0.
        case(
            "PodOomKilled",
            "a kill 4 minutes ago",
            one_kill_at_21,
            (CGROUP, 1),
            at="25m",
        ),
        case(
            "PodOomKilled",
            "a kill 7 minutes ago",
            one_kill_at_21,
            (CGROUP, 1),
            at="28m",
        ),
        case("PodOomKilled", "a kill 10 minutes ago", one_kill_at_21, at="31m"),
        case("PodOomKilled", "no kill", {selector(kills, CGROUP): const(2)}),
    )


def host_sysv_gpu() -> Tuple[Scenario, ...]:
    host = only(NODE)

    def pair(num: str, den: str, n: float, d: float, labels: Labels) -> Series:
        return merge(gauge(num, n, labels), gauge(den, d, labels))

    def host_memory(available: float) -> Series:
        return merge(
            pair(
                "shmwatch_host_memory_available_bytes",
                "shmwatch_host_memory_total_bytes",
                available,
                1000,
                host,
            ),
            gauge("shmwatch_host_memory_shmem_bytes", 50, host),
        )

    segs = ("shmwatch_sysv_segments", "shmwatch_sysv_limit_shmmni")
    sysv_bytes = ("shmwatch_sysv_bytes", "shmwatch_sysv_limit_shmall_bytes")
    gpu = ("shmwatch_gpu_memory_used_bytes", "shmwatch_gpu_memory_total_bytes")
    return (
        case("HostMemoryLow", "9.9 % available", host_memory(99), (host, 99 / 1000)),
        case("HostMemoryLow", "10 % available", host_memory(100)),
        case(
            "SysvSegmentsNearLimit",
            "901 of 1000",
            pair(*segs, 901, 1000, SYSV_HOST),
            (SYSV_HOST, 901 / 1000),
        ),
        case(
            "SysvSegmentsNearLimit",
            "a pod's IPC namespace, 950 of 1000",
            pair(*segs, 950, 1000, SYSV_POD),
            (SYSV_POD, 950 / 1000),
        ),
        case("SysvSegmentsNearLimit", "900 of 1000", pair(*segs, 900, 1000, SYSV_HOST)),
        case(
            "SysvBytesNearLimit",
            "901 of 1000",
            pair(*sysv_bytes, 901, 1000, SYSV_HOST),
            (SYSV_HOST, 901 / 1000),
        ),
        case(
            "SysvBytesNearLimit", "900 of 1000", pair(*sysv_bytes, 900, 1000, SYSV_HOST)
        ),
        case(
            "GpuMemoryNearlyFull",
            "98.1 % used",
            pair(*gpu, 981, 1000, GPU),
            (GPU, 981 / 1000),
        ),
        case("GpuMemoryNearlyFull", "98 % used", pair(*gpu, 980, 1000, GPU)),
        case("GpuMemoryNearlyFull", "vLLM's 92 %", pair(*gpu, 920, 1000, GPU)),
    )


def exporter() -> Tuple[Scenario, ...]:
    down, failing, gpu = (
        "ShmwatchDown",
        "ShmwatchCollectorFailing",
        "ShmwatchGpuCollectorFailing",
    )
    target = only(NODE)
    success = "shmwatch_collector_success"
    segments_failing = {**target, "collector": "segments"}
    gpu_collector = {**target, "collector": "gpu"}
    seen = {
        selector(
            "shmwatch_gpu_info", {**GPU, "name": "H100", "driver_version": "550"}
        ): "1x10"
    }
    return (
        case(down, "shmwatch not scraped", gauge("up", 0, SIDECAR), (SIDECAR, 0)),
        case(down, "shmwatch scraped", gauge("up", 1, SIDECAR)),
        case(
            down, "another job down", gauge("up", 0, only(SIDECAR, job="node-exporter"))
        ),
        case(
            failing,
            "the segments collector failing",
            gauge(success, 0, segments_failing),
            (segments_failing, 0),
        ),
        case(
            failing, "the segments collector fine", gauge(success, 1, segments_failing)
        ),
        case(
            failing, "only the GPU collector failing", gauge(success, 0, gpu_collector)
        ),
        # GPUs seen for 10 minutes, then NVML fails: the latch holds, the alert fires.
        case(
            gpu,
            "GPUs seen, then NVML failing",
            merge(seen, {selector(success, gpu_collector): "1x10 0x400"}),
            (gpu_collector, 0),
            covers=(Side(rule=gpu, index=0, side="both"),),
        ),
        case(
            gpu,
            "NVML failing on a node that never had a GPU",
            gauge(success, 0, gpu_collector),
            covers=(Side(rule=gpu, index=0, side="left"),),
        ),
        case(
            gpu,
            "GPUs seen, NVML answering",
            merge(seen, {selector(success, gpu_collector): const(1)}),
            covers=(Side(rule=gpu, index=0, side="right"),),
        ),
        case(
            gpu,
            "GPUs seen, NVML fine, another collector failing",
            merge(
                seen,
                {
                    selector(success, gpu_collector): const(1),
                    selector(success, segments_failing): const(0),
                },
            ),
        ),
    )


def recommendation(
    peak: float,
    used: float,
    working_set: float,
    limit: float,
    mounts: Tuple[Labels, ...] = (SHM,),
    cgroup: Labels = CGROUP,
) -> Series:
    """ShmRecommendationExceedsMemoryLimit's inputs: each mount's peak and used bytes, and its
    cgroup's working set and limit."""
    series: Series = {}
    for mount in mounts:
        series[selector("shmwatch_mount_peak_used_bytes", mount)] = const(peak)
        series[selector("shmwatch_mount_used_bytes", mount)] = const(used)
    series[selector("shmwatch_cgroup_memory_working_set_bytes", cgroup)] = const(
        working_set
    )
    series[
        selector("shmwatch_cgroup_memory_limit_bytes", {**cgroup, "limit_from": "self"})
    ] = const(limit)
    return series


def recommend() -> Tuple[Scenario, ...]:
    a = "ShmRecommendationExceedsMemoryLimit"
    # A peak of 8 GiB asks for 10 GiB of shm (x 1.25, a whole GiB); the rest of the pod uses
    # 3 - 1 GiB: the limit must hold 12 GiB.
    needed = 12 * GiB
    key = SHM
    two = (SHM, only(SHM, mount="/mnt/cache"))
    return (
        case(
            a,
            "a limit a byte short",
            recommendation(8 * GiB, GiB, 3 * GiB, needed - 1),
            (key, needed),
        ),
        case(a, "a limit just enough", recommendation(8 * GiB, GiB, 3 * GiB, needed)),
        case(
            a,
            "two mounts, each a byte short",
            recommendation(8 * GiB, GiB, 3 * GiB, needed - 1, two),
            (key, needed),
            (only(key, mount="/mnt/cache"), needed),
        ),
        case(
            a,
            "used shm above the working set",
            recommendation(8 * GiB, 4 * GiB, 3 * GiB, 10 * GiB - MiB),
            (key, 10 * GiB),
        ),
        # Node mode: pod u2 (4 GiB limit) needs 2 GiB of shm + 3 GiB besides; u1 fits.
        case(
            a,
            "node mode, one pod of two short",
            merge(
                recommendation(
                    GiB, 0, 3 * GiB, 4 * GiB, (pod_mount("u2"),), pod_cgroup("u2")
                ),
                recommendation(
                    GiB, 0, 3 * GiB, 8 * GiB, (pod_mount("u1"),), pod_cgroup("u1")
                ),
            ),
            (pod_mount("u2"), 5 * GiB),
        ),
        # The host's /dev/shm (node mode, no pod_uid) against the host's cgroups: the largest
        # working set and the largest limit. 32 GiB peak -> 40 GiB + 0.5 GiB fits 64 GiB (not
        # the smallest limit, 1 GiB, nor their mean); 4 GiB + 0.5 GiB does not fit 3.5 GiB
        # (nor would their sum, 6.5 GiB, say so).
        case(
            a,
            "the host's cgroups, the largest limit fits",
            host_recommendation(32 * GiB, 64 * GiB, GiB),
        ),
        case(
            a,
            "the host's cgroups, the largest limit is short",
            host_recommendation(3 * GiB + 200 * MiB, 3 * GiB + 512 * MiB, 3 * GiB),
            (HOST_SHM, 4 * GiB + 512 * MiB),
        ),
    )


HOST_SHM: Labels = {**NODE, "mount": "/dev/shm"}


def pod_mount(uid: str) -> Labels:
    return {**NODE, "pod_uid": uid, "volume": "dshm"}


def pod_cgroup(uid: str) -> Labels:
    return {**NODE, "pod_uid": uid}


def host_recommendation(peak: float, limit_a: float, limit_b: float) -> Series:
    """The host's /dev/shm, nothing used now, and two host cgroups: working sets 0.5 and
    0.25 GiB, limits limit_a and limit_b."""
    series = recommendation(
        peak, 0, GiB // 2, limit_a, (HOST_SHM,), {**NODE, "cgroup": "/system.slice"}
    )
    series.update(
        {
            selector(
                "shmwatch_cgroup_memory_working_set_bytes",
                {**NODE, "cgroup": "/user.slice"},
            ): const(GiB // 4),
            selector(
                "shmwatch_cgroup_memory_limit_bytes",
                {**NODE, "cgroup": "/user.slice", "limit_from": "self"},
            ): const(limit_b),
        }
    )
    return series


def scenarios() -> Tuple[Scenario, ...]:
    return throttled() + oom() + host_sysv_gpu() + exporter() + recommend()
