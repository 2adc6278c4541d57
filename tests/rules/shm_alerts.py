"""The /dev/shm alerts: for each, a builder of its input series (change the inputs there),
a case that fires with its exact value, cases that stay quiet at the threshold and for the
inputs it must ignore, and for each and/or/unless each side alone and both."""

from __future__ import annotations

from typing import Tuple

from tests.rules.labels import CACHE, POD_SHM, SHM, Labels, MiB
from tests.rules.scenario import (
    Scenario,
    Series,
    Side,
    const,
    fires,
    merge,
    only,
    selector,
)

AT = "45m"  # after every `for:` of these alerts
POD_U2: Labels = only(POD_SHM, pod_uid="u2")  # a second pod on the same node


def case(
    alert: str,
    name: str,
    series: Series,
    *firing: Tuple[Labels, float],
    at: str = AT,
    covers: Tuple[Side, ...] = (),
    values: bool = True,
) -> Scenario:
    return Scenario(
        name=f"{alert}: {name}",
        series=series,
        checks=(fires(alert, at, *firing),),
        covers=covers,
        values=values,
    )


def usage(ratio: float, labels: Labels = SHM, size_bytes: int = 1000) -> Series:
    """A mount that many bytes in size, used to that ratio (used / size: exactly the ratio)."""
    used = round(ratio * size_bytes)
    assert used / size_bytes == ratio, (
        f"{ratio} is not a whole number of bytes of {size_bytes}"
    )
    return {
        selector("shmwatch_mount_used_bytes", labels): const(used),
        selector("shmwatch_mount_size_bytes", labels): const(size_bytes),
    }


def filling(
    free_mib: int,
    mib_per_minute: int,
    size_mib: int,
    until_minute: int = 400,
    labels: Labels = SHM,
) -> Series:
    """A mount of size_mib filling at a steady rate from free_mib free, flat after until_minute:
    its free bytes (size - used) fall as an available-bytes series would."""
    used = (size_mib - free_mib) * MiB
    rise = f"{used}+{mib_per_minute * MiB}x{until_minute}"
    flat = (
        f" {used + mib_per_minute * until_minute * MiB}x{400 - until_minute}"
        if until_minute < 400
        else ""
    )
    return {
        selector("shmwatch_mount_used_bytes", labels): rise + flat,
        selector("shmwatch_mount_size_bytes", labels): const(size_mib * MiB),
    }


def resized_as_it_fills(
    used_parts: int, size_parts: int, labels: Labels = SHM
) -> Series:
    """A mount resized as it fills: used and size both multiples of k MiB, k from 100 growing 10
    a minute, so used / size stays exactly used_parts / size_parts while the bytes free shrink
    against the prediction (used grows 10 x used_parts MiB a minute)."""
    return {
        selector(
            "shmwatch_mount_used_bytes", labels
        ): f"{used_parts * 100 * MiB}+{used_parts * 10 * MiB}x400",
        selector(
            "shmwatch_mount_size_bytes", labels
        ): f"{size_parts * 100 * MiB}+{size_parts * 10 * MiB}x400",
    }


def peak(peak_used: float, size: float, used: float, labels: Labels = SHM) -> Series:
    return {
        selector("shmwatch_mount_peak_used_bytes", labels): const(peak_used),
        selector("shmwatch_mount_size_bytes", labels): const(size),
        selector("shmwatch_mount_used_bytes", labels): const(used),
    }


def size(size_bytes: float, labels: Labels = SHM) -> Series:
    return {selector("shmwatch_mount_size_bytes", labels): const(size_bytes)}


def segments(
    count: float, cls: str = "nccl", state: str = "linked", labels: Labels = SHM
) -> Series:
    return {
        selector("shmwatch_segments", {**labels, "class": cls, "state": state}): const(
            count
        )
    }


def segment_bytes(value: float, cls: str, state: str, labels: Labels = SHM) -> Series:
    return {
        selector(
            "shmwatch_segment_bytes", {**labels, "class": cls, "state": state}
        ): const(value)
    }


def gauge(name: str, value: float, labels: Labels = SHM) -> Series:
    return {selector(name, labels): const(value)}


def usage_alerts() -> Tuple[Scenario, ...]:
    out = []
    for alert, threshold, over in (
        ("ShmUsageHigh", 0.8, 0.81),
        ("ShmUsageCritical", 0.95, 0.96),
    ):
        out += [
            case(alert, "just over the threshold", usage(over), (SHM, over)),
            case(alert, "at the threshold", usage(threshold)),
            case(
                alert,
                "a pod's emptyDir (node mode)",
                usage(over, POD_SHM),
                (POD_SHM, over),
            ),
        ]
    return tuple(out)


# ShmFillingUp: size - predict_linear(used[30m], 3600) < 0 and used / size > 0.5: the bytes
# free in an hour, at the last 30 minutes' rate, below 0. A steady rise of 60 MiB a minute is
# 1 MiB a second: the prediction an hour on is exact, free now - 3600 MiB.
def filling_up() -> Tuple[Scenario, ...]:
    a, both = "ShmFillingUp", Side(rule="ShmFillingUp", index=0, side="both")
    at = 20  # minutes: predicted below zero from minute 7 (4000 - 60 x 7 < 3600), firing from 17
    predicted = (4000 - 60 * at - 3600) * MiB
    # 9000 bytes, 4019 free and a byte a second more used: over half full all along.
    byte_a_second = {
        selector("shmwatch_mount_used_bytes", SHM): "4981+60x400",
        selector("shmwatch_mount_size_bytes", SHM): const(9000),
    }
    return (
        # Both sides, different values: the alert's value is the prediction, not the ratio
        # (8200 MiB: over half full from the start).
        case(
            a,
            "filling, predicted full, over half full",
            filling(4000, 60, size_mib=8200),
            (SHM, predicted),
            at=f"{at}m",
            covers=(both,),
        ),
        # 5000 MiB: 2200 used at minute 20, under half full.
        case(
            a,
            "filling, predicted full, under half full",
            filling(4000, 60, size_mib=5000),
            at=f"{at}m",
            covers=(Side(rule=a, index=0, side="left"),),
        ),
        case(
            a,
            "nine tenths full, steady",
            usage(0.9),
            at=f"{at}m",
            covers=(Side(rule=a, index=0, side="right"),),
        ),
        # 5600 MiB: exactly half full at minute 20, never over it before.
        case(
            a,
            "filling, reaching half full",
            filling(4000, 60, size_mib=5600),
            at=f"{at}m",
        ),
        # Resized as it fills, so the ratio holds and the prediction is below 0 all along:
        # exactly half full (not over half; free in an hour k - 600 MiB), and 52 % full (over
        # half, not over 55 %): used 13 k and size 25 k MiB, k = 100 + 10 a minute, free in an
        # hour 12 k - 7800 MiB, -4200 at minute 20.
        case(
            a,
            "filling, exactly half full all along",
            resized_as_it_fills(1, 2),
            at=f"{at}m",
        ),
        case(
            a,
            "filling, 52 % full all along",
            resized_as_it_fills(13, 25),
            (SHM, -4200 * MiB),
            at=f"{at}m",
        ),
        case(
            a, "filling, lasts the hour", filling(8000, 60, size_mib=80000), at=f"{at}m"
        ),
        # A full mount stays full (ShmUsageCritical's case): predicted exactly 0, not below.
        case(a, "full and flat: predicted 0", usage(1.0)),
        # A nearly full mount filling a byte a second: predicted 4019 - 60 t - 3600 bytes free,
        # -1 at minute 7, so pending from 7 and firing 10 minutes later, at 17, not before.
        case(
            a,
            "a byte a second, at for: 10m",
            byte_a_second,
            (SHM, 4019 - 60 * 17 - 3600),
            at="17m",
        ),
        case(a, "a byte a second, a minute short of for: 10m", byte_a_second, at="16m"),
        # The window: a rise that stopped 26 minutes ago still shows over the last 30
        # minutes, not over the last 15 (values: a regression over a bent line is not exact).
        case(
            a,
            "a rise 26 minutes ago",
            filling(2600, 100, size_mib=6000, until_minute=24),
            (SHM, 0.0),
            at="50m",
            values=False,
        ),
        # ... and one that stopped 45 minutes ago shows over the last hour only: quiet.
        case(
            a,
            "a rise 45 minutes ago",
            filling(1800, 60, size_mib=6000, until_minute=25),
            at="70m",
        ),
    )


def peak_near_full() -> Tuple[Scenario, ...]:
    a = "ShmPeakNearFull"
    return (
        case(
            a,
            "peaked at 97 %, half full now",
            peak(97, 100, 50),
            (SHM, 97 / 100),
            covers=(Side(rule=a, index=0, side="both"),),
        ),
        case(
            a,
            "peaked at 97 %, no used bytes",
            {
                k: v
                for k, v in peak(97, 100, 50).items()
                if not k.startswith("shmwatch_mount_used_bytes")
            },
            covers=(Side(rule=a, index=0, side="left"),),
        ),
        case(
            a,
            "half full, no peak",
            usage(0.5),
            covers=(Side(rule=a, index=0, side="right"),),
        ),
        case(a, "peaked at 95 %", peak(95, 100, 50)),
        case(a, "peaked at 97 %, at 95 % now", peak(97, 100, 95), (SHM, 97 / 100)),
        case(
            a,
            "peaked at 97 %, over 95 % now (ShmUsageCritical's)",
            peak(970, 1000, 951),
        ),
    )


def docker_default() -> Tuple[Scenario, ...]:
    a = "ShmDockerDefaultSize"
    small = 64 * MiB
    return (
        case(
            a,
            "64 MiB with NCCL segments",
            merge(size(small), segments(3)),
            (SHM, small),
            covers=(Side(rule=a, index=0, side="both"),),
        ),
        case(
            a,
            "64 MiB with one torch segment",
            merge(size(small), segments(1, "torch")),
            (SHM, small),
        ),
        case(
            a,
            "a pod's 64 MiB emptyDir with MPI segments",
            merge(size(small, POD_SHM), segments(2, "mpi", "linked", POD_SHM)),
            (POD_SHM, small),
        ),
        case(
            a,
            "64 MiB, no segments series",
            size(small),
            covers=(Side(rule=a, index=0, side="left"),),
        ),
        case(
            a,
            "NCCL segments, no size",
            segments(3),
            covers=(Side(rule=a, index=0, side="right"),),
        ),
        case(a, "a byte over 64 MiB", merge(size(small + 1), segments(3))),
        case(
            a,
            "64 MiB used by vLLM's offload only",
            merge(size(small), segments(3, "vllm_offload")),
        ),
        case(a, "64 MiB, NCCL's segments gone", merge(size(small), segments(0))),
        case(
            a,
            "64 MiB, NCCL's gone, torch's there",
            merge(size(small), segments(0), segments(3, "torch")),
            (SHM, small),
        ),
        # Node mode: each pod's mount on its own (pod u2's NCCL segments are not pod u1's).
        case(
            a,
            "node mode, two 64 MiB emptyDirs, NCCL in one",
            merge(
                size(small, POD_SHM),
                segments(2, "vllm_offload", "linked", POD_SHM),
                size(small, POD_U2),
                segments(2, "nccl", "linked", POD_U2),
            ),
            (POD_U2, small),
        ),
    )


def leaked() -> Tuple[Scenario, ...]:
    a = "ShmLeakedSegments"
    pod_b = POD_U2
    return (
        # 80 + 30 orphan bytes of removable classes on 1000: 11 %.
        case(
            a,
            "removable orphans over 10 %, beside a second mount",
            merge(
                size(1000),
                segment_bytes(80, "python_shm", "orphan"),
                segment_bytes(30, "nccl", "orphan"),
                size(1000, CACHE),
                segment_bytes(120, "torch", "orphan", CACHE),
            ),
            (SHM, 110 / 1000),
            (CACHE, 120 / 1000),
        ),
        case(
            a,
            "orphans at 10 %",
            merge(size(1000), segment_bytes(100, "torch", "orphan")),
        ),
        case(
            a,
            "orphan semaphores",
            merge(size(1000), segment_bytes(900, "semaphore", "orphan")),
        ),
        case(
            a,
            "orphans of class other",
            merge(size(1000), segment_bytes(900, "other", "orphan")),
        ),
        case(
            a,
            "linked and unverified segments",
            merge(
                size(1000),
                segment_bytes(900, "nccl", "linked"),
                segment_bytes(900, "torch", "unverified"),
            ),
        ),
        # Node mode: each pod's mount on its own (pod u2's leak is not pod u1's).
        case(
            a,
            "node mode, one pod's mount",
            merge(
                size(1000, POD_SHM),
                segment_bytes(300, "ucx", "orphan", POD_SHM),
                size(1000, pod_b),
                segment_bytes(50, "ucx", "orphan", pod_b),
            ),
            (POD_SHM, 300 / 1000),
        ),
    )


def hidden_and_state() -> Tuple[Scenario, ...]:
    old, hidden = "ShmLeakedSegmentsOld", "ShmHiddenSegmentsLarge"
    age = "shmwatch_orphan_oldest_age_seconds"
    return (
        case(old, "six hours and a second", gauge(age, 21601), (SHM, 21601)),
        case(old, "six hours", gauge(age, 21600)),
        case(
            hidden,
            "hidden over half, beside a second mount",
            merge(
                size(1000),
                segment_bytes(501, "nccl", "hidden"),
                size(100, CACHE),
                segment_bytes(1, "nccl", "hidden", CACHE),
            ),
            (SHM, 501 / 1000),
        ),
        case(
            hidden,
            "hidden at half",
            merge(size(1000), segment_bytes(500, "nccl", "hidden")),
        ),
        case(
            hidden,
            "hidden over half in two classes",
            merge(
                size(1000),
                segment_bytes(300, "nccl", "hidden"),
                segment_bytes(250, "torch", "hidden"),
            ),
            (SHM, (300 + 250) / 1000),
        ),
        case(
            hidden,
            "orphans, not hidden",
            merge(size(1000), segment_bytes(900, "nccl", "orphan")),
        ),
        case(
            "ShmMountMissing",
            "cannot be measured",
            gauge("shmwatch_mount_error", 1),
            (SHM, 1),
        ),
        # A measured mount has its size, and no error series (shmwatch writes none at 0).
        case("ShmMountMissing", "measured", size(1000)),
        case(
            "ShmInventoryDegraded",
            "degraded",
            gauge("shmwatch_inventory_degraded", 1, CACHE),
            (CACHE, 1),
        ),
        case("ShmInventoryDegraded", "whole", gauge("shmwatch_inventory_degraded", 0)),
    )


def scenarios() -> Tuple[Scenario, ...]:
    return (
        usage_alerts()
        + filling_up()
        + peak_near_full()
        + docker_default()
        + leaked()
        + hidden_and_state()
    )
