"""Which leaks users are told to remove: for every segment class, a real file left in a real
tmpfs by a process that exited, seen end to end: its state on /metrics, the shipped
ShmLeakedSegments rule on those very series, the oldest-orphan age, `shmwatch check`'s advice
in text and JSON, and its exit code.

An orphan of a class whose segment belongs to one process (NCCL, UCX, torch, SharedMemory,
vLLM offload, MPI, SGLang) is removable: `rm` advised, counted by ShmLeakedSegments, check
exits 1. Any other orphan is named (a semaphore not even that) and nothing more: `rm` never
advised, the alert quiet, check exits 0 for it.

One world (tests/peers/world.py) holds a 65 MiB tmpfs per class under /mnt with one 8 MiB
leak in each (above ShmLeakedSegments' 10 %, above Docker's 64 MiB default so size raises no
warning of its own), and a live server holding a segment in /dev/shm."""

from functools import lru_cache
from pathlib import Path
from typing import Any, Dict

import pytest

from exporter.model.classes import CLASS_NAMES
from tests.conftest import needs_root, parse_exposition, select, value
from tests.helpers import removal_advised, run_world
from tests.system.test_rules import promtool_test

pytestmark = needs_root

MiB = 1 << 20
LEAK_BYTES = 8 * MiB
AGE = 7200  # the leaks were last written two hours ago
# A real name of each class (the class table's sources), and whether its orphans are removable.
EXAMPLES = {
    "nccl": ("nccl-Xk29aQ", True),
    "ucx": ("ucx_shm_posix_5f3a2b1c", True),
    "torch": ("torch_4242_3091822_0", True),
    "python_shm": ("psm_9f3e2a1b", True),
    "vllm_offload": ("vllm_offload_3b9d0c.mmap", True),
    "mpi": ("vader_segment.node1.5e2a0001.0", True),
    "sglang": ("sgl_shm_mm_4242_3b9d", True),
    "semaphore": ("sem.mp-7y2kq", False),
    "ray": ("plasma_store_4242", False),
    "nixl": ("nixl_agent_0", False),
    "dali": ("nvidia_dali_3f2a", False),
    "triton": ("triton_python_backend_shm_region_1", False),
    "cuda": ("cuda.shm.4242.0", False),
    "other": ("libpod_lock", False),
}
REMOVABLE_CLASSES = {c for c, (_, removable) in EXAMPLES.items() if removable}


def mount_of(cls: str) -> str:
    return f"/mnt/{cls}"


def path_of(cls: str) -> str:
    return f"{mount_of(cls)}/{EXAMPLES[cls][0]}"


@lru_cache(maxsize=None)
def every_class() -> Dict[str, Any]:
    server = dict(
        mode="mapped", name="psm_live0001", size=MiB, uid=1000
    )  # the workload, alive
    exporter = dict(
        uid=0,
        ignore="",
        serve=True,
        text=True,
        args=[f"--shm.mount={mount_of(c)}" for c in EXAMPLES],
    )
    report = run_world(
        dict(
            hidepid="0",
            holders=[server],
            mounts={mount_of(c): "65m" for c in EXAMPLES},
            left=[
                dict(name=path_of(c), size=LEAK_BYTES, uid=1000, age=AGE)
                for c in EXAMPLES
            ],
            exporters={"root": exporter},
        )
    )
    run: Dict[str, Any] = report["runs"]["root"]
    assert isinstance(run["check"], dict), run["stderr"]
    return run


def test_every_class_has_its_example() -> None:
    assert set(EXAMPLES) == set(CLASS_NAMES)


@pytest.mark.parametrize("cls", sorted(EXAMPLES))
def test_a_leak_is_removable_exactly_when_its_class_is(cls: str) -> None:
    run = every_class()
    removable, mount, path = cls in REMOVABLE_CLASSES, mount_of(cls), path_of(cls)
    # /metrics: an orphan, whatever its class: state says who holds it, not what to do.
    samples = parse_exposition(run["metrics"])
    assert (
        value(
            samples, "shmwatch_segments", mount=mount, state="orphan", **{"class": cls}
        )
        == 1
    )
    assert (
        value(
            samples,
            "shmwatch_segment_bytes",
            mount=mount,
            state="orphan",
            **{"class": cls},
        )
        == LEAK_BYTES
    )
    # ShmLeakedSegmentsOld's input: the age of the oldest removable one only.
    age = value(samples, "shmwatch_orphan_oldest_age_seconds", mount=mount)
    assert age is not None
    assert (AGE <= age < AGE + 600) if removable else age == 0, age
    # check: `rm` advised (a warning: exit 1) for removable classes only; the others named
    # without it, except semaphores (meant to outlive their creators: not leaks).
    doc = run["check"]
    about = [
        f
        for f in doc["findings"]
        if f["subject"] == mount and EXAMPLES[cls][0] in f["message"] + f["remedy"]
    ]
    assert (path in removal_advised(doc)) == removable, about
    if removable:
        [said] = about
        assert said["severity"] == "warn" and said["message"].startswith(
            "1 leaked segment(s)"
        ), said
        assert said["remedy"] == f"once no server can attach to them: rm -- {path}", said
        assert f"rm -- {path}" in run["text"]
    elif cls != "semaphore":
        [said] = about
        assert said["severity"] == "info" and "rm" not in said["remedy"].split(), said
    else:
        assert about == []
    assert f"rm -- {path}" not in run["text"] or removable
    [facts] = [m for m in doc["shm"] if m["mount"] == mount]
    assert [o["name"] for o in facts["orphans"]] == (
        [] if cls == "semaphore" else [EXAMPLES[cls][0]]
    )


def test_check_exits_1_for_removable_leaks_and_0_without_them() -> None:
    assert every_class()["rc"] == every_class()["check"]["exit_code"] == 1
    # The same world without a removable class: nothing to do, nothing failed.
    others = [c for c in EXAMPLES if c not in REMOVABLE_CLASSES]
    report = run_world(
        dict(
            hidepid="0",
            holders=[dict(mode="mapped", name="psm_live0001", size=MiB, uid=1000)],
            left=[dict(name=EXAMPLES[c][0], size=MiB, uid=1000) for c in others],
            exporters={"root": dict(uid=0, ignore="")},
        )
    )
    run = report["runs"]["root"]
    doc = run["check"]
    assert run["rc"] == doc["exit_code"] == 0, doc["findings"]
    assert removal_advised(doc) == set()
    [facts] = doc["shm"]
    assert {o["name"] for o in facts["orphans"]} == {
        EXAMPLES[c][0] for c in others if c != "semaphore"
    }


def test_the_shipped_leak_alert_fires_on_the_real_series_of_removable_classes_only(
    tmp_path: Path,
) -> None:
    """The shipped rule (deploy/prometheus/shmwatch-rules.yml), fed the series /metrics gave
    for the real leaks (a mount a class): it fires for each mount of a removable class only."""
    samples = parse_exposition(every_class()["metrics"])
    series = {}
    for name in ("shmwatch_segment_bytes", "shmwatch_mount_size_bytes"):
        for labels, v in select(samples, name):
            matchers = ", ".join(
                f'{k}="{val}"'
                for k, val in sorted(
                    {**labels, "instance": "a", "job": "shmwatch"}.items()
                )
            )
            series[f"{name}{{{matchers}}}"] = f"{v:.0f}x20"
    expected = [
        {
            "exp_labels": {
                "instance": "a",
                "job": "shmwatch",
                "mount": mount_of(c),
                "severity": "warning",
            }
        }
        for c in sorted(REMOVABLE_CLASSES)
    ]
    promtool_test(
        tmp_path,
        {
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": [
                {
                    "eval_time": "20m",
                    "alertname": "ShmLeakedSegments",
                    "exp_alerts": expected,
                }
            ],
        },
    )
