# mypy: allow-untyped-calls
"""A memory cgroup's files as the collector reports them (v1 and v2): usage, the limit that
binds and where, the working set the OOM killer weighs, shmem, OOM kills, memory.high and
swap; and where a cgroupfs mount shows a cgroup. Fixture directories: part of the mutation
selection."""

import dataclasses
from pathlib import Path
from typing import Any, Dict

import pytest

from exporter.host.cgroupfs import (
    V1_UNLIMITED,
    cgroup_directories,
    read_files,
    read_flat_keyed,
    read_limit,
)
from exporter.host.mountinfo import MountEntry

GiB, MiB = 1 << 30, 1 << 20
POD = "pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def cgroup(root: Path, relative: str, files: Dict[str, str]) -> str:
    directory = root / relative
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return str(directory)


def read(directory: str, version: int, with_swap: bool = True) -> Dict[str, Any]:
    """read_files' record as one flat dict: the binding limit's bytes and source beside the rest."""
    got = dataclasses.asdict(read_files(directory, version, with_swap=with_swap))
    limit = got.pop("limit")
    return {**got, **limit}


V2_STAT = "anon 2147483648\nfile 1073741824\nshmem 805306368\ninactive_file 268435456\nfile_mapped 5\n"


def test_a_v2_cgroup_read_whole(tmp_path: Path) -> None:
    cgroup(tmp_path, "kubepods", {"memory.max": "max\n"})
    d = cgroup(
        tmp_path,
        f"kubepods/{POD}/ctr",
        {
            "memory.current": "3221225472\n",
            "memory.max": "8589934592\n",
            "memory.stat": V2_STAT,
            "memory.events": "low 0\nhigh 7\nmax 12\noom 2\noom_kill 1\n",
            "memory.high": "6442450944\n",
            "memory.swap.current": "4096\n",
            "memory.swap.max": "max\n",
        },
    )
    assert read(d, 2) == dict(
        usage_bytes=3 * GiB,
        limit_bytes=8 * GiB,
        limit_source="self",
        working_set_bytes=3 * GiB - 256 * MiB,
        shmem_bytes=768 * MiB,
        oom_kills=1,
        high_bytes=6 * GiB,
        events=(("high", 7), ("low", 0), ("max", 12), ("oom", 2), ("oom_kill", 1)),
        swap_bytes=4096,
        swap_limit_bytes=None,
    )


def test_a_v2_cgroup_without_optional_files(tmp_path: Path) -> None:
    d = cgroup(
        tmp_path, "a", {"memory.current": "1000\n", "memory.stat": "anon 1000\n"}
    )
    got = read(d, 2)
    assert (
        got["limit_bytes"],
        got["limit_source"],
        got["oom_kills"],
        got["events"],
    ) == (None, "none", None, ())
    assert (
        got["high_bytes"],
        got["swap_bytes"],
        got["swap_limit_bytes"],
        got["shmem_bytes"],
    ) == (None,) * 4
    assert got["working_set_bytes"] == 1000


def test_on_a_node_without_swap_v2_swap_is_not_read(tmp_path: Path) -> None:
    d = cgroup(
        tmp_path,
        "a",
        {
            "memory.current": "1000\n",
            "memory.stat": "swap 5\n",
            "memory.swap.current": "4096\n",
            "memory.swap.max": "1048576\n",
        },
    )
    assert (read(d, 2)["swap_bytes"], read(d, 2)["swap_limit_bytes"]) == (
        4096,
        1048576,
    )
    without = read(d, 2, with_swap=False)
    assert (without["swap_bytes"], without["swap_limit_bytes"]) == (None, None)


def test_the_working_set_never_goes_below_zero(tmp_path: Path) -> None:
    d = cgroup(
        tmp_path,
        "a",
        {"memory.current": "1000\n", "memory.stat": "inactive_file 5000\n"},
    )
    assert read(d, 2)["working_set_bytes"] == 0


def test_a_v1_cgroup_counts_its_descendants_and_sees_limits_above_its_namespace(
    tmp_path: Path,
) -> None:
    d = cgroup(
        tmp_path,
        "memory/kubepods/burstable/" + POD,
        {
            "memory.usage_in_bytes": "1073741824\n",
            "memory.limit_in_bytes": f"{V1_UNLIMITED + 4096}\n",
            "memory.stat": (
                "cache 1\nshmem 5\ninactive_file 7\nswap 9\n"
                "hierarchical_memory_limit 2147483648\n"
                "total_shmem 268435456\ntotal_inactive_file 134217728\ntotal_swap 4096\n"
            ),
            "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
            "memory.failcnt": "17\n",
        },
    )
    got = read(d, 1)
    assert (got["limit_bytes"], got["limit_source"]) == (2 * GiB, "ancestor")
    assert (got["usage_bytes"], got["working_set_bytes"]) == (GiB, GiB - 128 * MiB)
    assert (got["shmem_bytes"], got["oom_kills"], got["swap_bytes"]) == (
        256 * MiB,
        2,
        4096,
    )
    assert got["events"] == (("max", 17), ("oom_kill", 2))
    assert (got["high_bytes"], got["swap_limit_bytes"]) == (None, None)


def test_v1_hierarchical_limit_counts_only_when_tighter(tmp_path: Path) -> None:
    files = {
        "memory.usage_in_bytes": "100\n",
        "memory.limit_in_bytes": "1073741824\n",
        "memory.stat": "hierarchical_memory_limit 2147483648\n",
    }
    d = cgroup(tmp_path, "memory/a", files)
    assert (read(d, 1)["limit_bytes"], read(d, 1)["limit_source"]) == (
        GiB,
        "self",
    )
    files["memory.stat"] = (
        "hierarchical_memory_limit 1073741824\n"  # equal: the cgroup's own
    )
    d = cgroup(tmp_path, "memory/b", files)
    assert read(d, 1)["limit_source"] == "self"
    files["memory.stat"] = f"hierarchical_memory_limit {V1_UNLIMITED}\n"
    files["memory.limit_in_bytes"] = f"{V1_UNLIMITED}\n"
    d = cgroup(tmp_path, "memory/c", files)
    assert (read(d, 1)["limit_bytes"], read(d, 1)["limit_source"]) == (
        None,
        "none",
    )
    files["memory.stat"] = f"hierarchical_memory_limit {V1_UNLIMITED - 4096}\n"
    d = cgroup(tmp_path, "memory/d", files)
    assert (read(d, 1)["limit_bytes"], read(d, 1)["limit_source"]) == (
        V1_UNLIMITED - 4096,
        "ancestor",
    )


def test_a_v1_cgroup_without_its_oom_counters(tmp_path: Path) -> None:
    d = cgroup(
        tmp_path,
        "memory/a",
        {"memory.usage_in_bytes": "100\n", "memory.stat": "total_shmem 0\n"},
    )
    got = read(d, 1)
    assert (got["events"], got["oom_kills"], got["shmem_bytes"]) == ((), None, 0)


def test_a_cgroup_without_usage_is_an_error(tmp_path: Path) -> None:
    d = cgroup(tmp_path, "a", {"memory.stat": "anon 1\n"})
    with pytest.raises(FileNotFoundError):
        read_files(d, 2)
    with pytest.raises(FileNotFoundError):
        read_files(str(tmp_path / "gone"), 2)


def test_a_missing_file_reads_as_missing_any_other_error_is_raised(
    tmp_path: Path,
) -> None:
    assert read_limit(str(tmp_path), "memory.high") is None
    assert read_flat_keyed(str(tmp_path), "memory.events") == {}
    (tmp_path / "memory.high").mkdir()
    with pytest.raises(IsADirectoryError):
        read_limit(str(tmp_path), "memory.high")
    (tmp_path / "memory.events").mkdir()
    with pytest.raises(IsADirectoryError):
        read_flat_keyed(str(tmp_path), "memory.events")


def mount(point: str, fstype: str, root: str, options: str = "rw") -> MountEntry:
    return MountEntry(point, fstype, fstype, options, "0:30", root)


def test_where_mounted_cgroupfs_shows_a_cgroup() -> None:
    entries = [
        mount("/sys/fs/cgroup/memory", "cgroup", "/", "rw,nosuid,memory"),
        mount("/sys/fs/cgroup/cpu", "cgroup", "/", "rw,cpu,cpuacct"),
        mount("/host/sys/fs/cgroup", "cgroup2", "/"),
        mount("/sidecar/cgroup", "cgroup2", "/kubepods/pod1"),
    ]
    path = "/kubepods/pod1/ctr"
    assert cgroup_directories(entries, path, 1) == [
        "/sys/fs/cgroup/memory/kubepods/pod1/ctr"
    ]
    assert cgroup_directories(entries, path, 2) == [
        "/host/sys/fs/cgroup/kubepods/pod1/ctr",
        "/sidecar/cgroup/ctr",
    ]
    assert cgroup_directories(entries, "/other", 2) == ["/host/sys/fs/cgroup/other"]
    # Another container's cgroup, seen from a private cgroup namespace: only a mount rooted
    # above it shows it, and never through directories this namespace cannot name.
    assert cgroup_directories([mount("/c", "cgroup2", "/..")], "/../x/ctr", 2) == [
        "/c/x/ctr"
    ]
    assert cgroup_directories([mount("/c", "cgroup2", "/../..")], "/../x", 2) == []
