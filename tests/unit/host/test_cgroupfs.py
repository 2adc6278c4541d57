# mypy: allow-untyped-calls
"""A memory cgroup's files as the collector reports them (v1 and v2): usage, the limit that
binds and where, the working set the OOM killer weighs, shmem, OOM kills, memory.high and
swap; and where a cgroupfs mount shows a cgroup. Fixture directories: part of the mutation
selection."""

import dataclasses
import string
from pathlib import Path
from typing import Any, Dict

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from exporter.collectors.host_memory import parse_meminfo
from exporter.collectors.sysv import parse_sysvipc_shm
from exporter.host.cgroupfs import (
    STAT_KEYS,
    V1_UNLIMITED,
    BindingLimit,
    below,
    cgroup_directories,
    effective_limit,
    parse_flat_keyed,
    parse_limit,
    read_files,
    read_flat_keyed,
    read_limit,
)
from exporter.host.mountinfo import MountEntry, parse_mountinfo
from exporter.host.proctable import parse_proc_cgroup
from tests.helpers import any_text, cgroup_tree

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


@pytest.mark.parametrize("version", [1, 2])
def test_of_equal_limits_the_outermost_binds(tmp_path, version):
    """(kubepods, burstable, pod, container) limits -> (limit, where it binds): the smallest;
    of equal ones the outermost (a container as tight as its pod is read as the pod)."""
    cases = {
        (None, None, GiB, GiB): (GiB, "pod"),
        (None, GiB, GiB, GiB): (GiB, "ancestor"),
        (None, GiB, 2 * GiB, GiB): (GiB, "ancestor"),
        (None, None, GiB, GiB - 4096): (GiB - 4096, "self"),
        (None, None, GiB, None): (GiB, "pod"),
        (GiB, None, 2 * GiB, None): (GiB, "ancestor"),
        (None, None, None, GiB): (GiB, "self"),
        (None, None, None, None): (None, "none"),
    }
    for i, (limits, (limit, where)) in enumerate(cases.items()):
        want = BindingLimit(limit_bytes=limit, limit_source=where)
        ctr = cgroup_tree(str(tmp_path / str(i)), limits, version)
        assert effective_limit(ctr, version) == want, limits
        above = {}
        assert effective_limit(ctr, version, above) == want, limits
        assert effective_limit(ctr, version, above) == want, limits  # from the memo
        # A private cgroup namespace's own cgroup: "/", read at "/sys/fs/cgroup/".
        assert effective_limit(ctr + "/", version) == want, limits


def test_cgroup_parsers():
    assert parse_proc_cgroup("12:memory:/a/b\n3:cpu,cpuacct:/c\n0::/d\n") == {
        "memory": "/a/b", "cpu": "/c", "cpuacct": "/c", "": "/d"}
    assert parse_limit("max\n") is None
    assert parse_limit("9223372036854771712\n") is None  # v1's "unlimited"
    assert parse_limit("2147483648") == 2 << 30
    assert parse_flat_keyed("anon 1\nfile x\nbad\n\nshmem 3") == {"anon": 1, "shmem": 3}


def test_error_messages_name_the_value():
    import pytest

    from exporter.config import parse_duration, parse_size
    with pytest.raises(ValueError, match=r"^invalid duration '0': must be above 0$"):
        parse_duration("0")
    with pytest.raises(ValueError, match=r"^invalid duration '9{400}': too large$"):
        parse_duration("9" * 400)
    with pytest.raises(ValueError, match=r"^invalid size 'lots' \(use e.g. 64Mi, 16Gi, 2g\)$"):
        parse_size("lots")
    with pytest.raises(ValueError, match=r"^sysvipc/shm: unexpected header a b c d e f g h$"):
        parse_sysvipc_shm("a b c d e f g h i j\n")


def test_malformed_lines_in_the_middle_are_skipped():
    assert parse_meminfo("MemTotal: 2 kB\nbroken\nShmem: x kB\nMemFree: 1 kB\n") == {"MemTotal": 2048,
                                                                                       "MemFree": 1024}
    assert parse_meminfo("X: 5 kB: y\n") == {"X": 5}  # the first colon ends the key
    assert parse_proc_cgroup("12:memory:/a\ngarbage\n0::/b\n") == {"memory": "/a", "": "/b"}
    assert parse_proc_cgroup("3:memory:\n") == {"memory": ""}
    text = "key shmid size nattch\n1 2 3 4\n5 6\n7 8 9 10\n"  # only the four columns needed
    assert [(s.key, s.nattch) for s in parse_sysvipc_shm(text)] == [(1, 4), (7, 10)]


def test_v1_unlimited_boundary():
    from exporter.host.cgroupfs import V1_UNLIMITED
    assert parse_limit(str(V1_UNLIMITED)) is None
    assert parse_limit(str(V1_UNLIMITED - 1)) == V1_UNLIMITED - 1


stat_keys = st.text(string.ascii_lowercase + "_", min_size=1, max_size=24)


@given(st.dictionaries(stat_keys, st.integers(-(1 << 63), (1 << 64) - 1), max_size=20))
def test_flat_keyed_round_trip(values):
    assert parse_flat_keyed("".join(f"{k} {v}\n" for k, v in values.items())) == values


@given(any_text)
def test_flat_keyed_any_text(text):
    assert all(isinstance(v, int) for v in parse_flat_keyed(text).values())


stat_lines = st.tuples(st.sampled_from(sorted(STAT_KEYS) + ["anon", "file"]), st.text("0123456789 x-\t", max_size=8))


@given(st.one_of(any_text, st.lists(stat_lines).map(lambda kv: "\n".join(f"{k} {v}" for k, v in kv))))
def test_flat_keyed_of_some_keys_is_the_whole_parse_cut_down(text):
    """memory.stat parsed for the keys read_files takes: exactly those of the whole parse."""
    whole = parse_flat_keyed(text)
    assert parse_flat_keyed(text, STAT_KEYS) == {k: v for k, v in whole.items() if k in STAT_KEYS}


@given(st.integers(0, (1 << 64) - 1), st.sampled_from(["", "\n", " \n"]))
def test_limit_round_trip(limit, tail):
    assert parse_limit(f"{limit}{tail}") == (None if limit >= V1_UNLIMITED else limit)
    assert parse_limit(f"max{tail}") is None


limit_texts = st.one_of(
    any_text,
    st.builds(lambda n, pad, tail: f"{pad}{n}{tail}", st.one_of(st.integers(-2, (1 << 64)),
                                                             st.integers(V1_UNLIMITED - 2, V1_UNLIMITED + 2)),
              st.sampled_from(["", " ", "\t"]), st.sampled_from(["", "\n", "x", " 5"])),
)


@given(limit_texts)
@example("-1\n")
@example(f" {V1_UNLIMITED - 1}\n")
@example(f"{V1_UNLIMITED}")
@example("max\n")
@example("0")
def test_limit_is_the_number_in_the_file_or_none_only_for_unlimited(text):
    """Anything else than one number (or "max") is a ValueError, never a guessed limit; None
    only for "max" and v1's unlimited and above; any other number is the limit itself."""
    try:
        result = parse_limit(text)
    except ValueError:
        return
    written = text.strip()
    if result is None:
        assert written == "max" or int(written) >= V1_UNLIMITED
    else:
        assert result == int(written) < V1_UNLIMITED


# A Docker sidecar on cgroup v1: its own memory cgroup mounted at /sys/fs/cgroup/memory (root
# /docker/<sidecar>), and the host's cgroupfs given read-only at /host/sys/fs/cgroup.
MOUNTINFO_V1 = """\
600 590 0:30 /docker/sidecar /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory
610 590 0:30 / /host/sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory
611 590 0:31 / /host/sys/fs/cgroup/cpu ro,nosuid - cgroup cgroup rw,cpu
"""
# cgroup v2 with a private cgroup namespace: the host's cgroupfs, seen from inside it, is
# rooted above the namespace (mountinfo shows /../..), and another container reads /../<id>.
MOUNTINFO_V2 = """\
700 690 0:40 / /sys/fs/cgroup ro - cgroup2 cgroup2 rw
710 690 0:40 /../.. /host/sys/fs/cgroup ro - cgroup2 cgroup2 rw
"""


def test_the_workload_cgroup_is_found_under_the_mount_that_shows_it():
    entries = parse_mountinfo(MOUNTINFO_V1)
    assert cgroup_directories(entries, "/docker/server", 1) == ["/host/sys/fs/cgroup/memory/docker/server"]
    assert cgroup_directories(entries, "/docker/sidecar/x", 1) == ["/sys/fs/cgroup/memory/x",
                                                                   "/host/sys/fs/cgroup/memory/docker/sidecar/x"]
    assert cgroup_directories(entries, "/docker/server", 2) == []  # no v2 mount here


def test_paths_above_a_private_namespace_root():
    entries = parse_mountinfo(MOUNTINFO_V2)
    # A sibling of our namespace's root (/../docker-server.scope) under a mount rooted two
    # levels up (/../..): the directory in between has a name nobody here can tell, so no
    # directory is guessed (the sidecar estimates instead; --cgroupns=host makes paths whole).
    assert cgroup_directories(entries, "/../docker-server.scope", 2) == []
    assert below("/../a/b", "/..") == ["a", "b"]  # a mount rooted at the parent: the name is known
    assert below("/../docker-server.scope", "/") is None  # not under our namespace's root
    assert below("/a/b", "/a") == ["b"] and below("/a", "/a") == [] and below("/ab", "/a") is None
