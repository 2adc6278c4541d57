"""A memory cgroup's files (v1 and v2): where a mount shows them, read, parsed, and the
limit that binds it."""

import os
from contextlib import suppress
from typing import Dict, Iterable, List, Optional

from exporter.host.kube import POD_CGROUP_DIR
from exporter.host.mountinfo import MountEntry
from exporter.host.paths import read_text

# A v1 limit at or above 2^62 is none (v1 writes PAGE_COUNTER_MAX pages: 9223372036854771712 B).
V1_UNLIMITED = 1 << 62
USAGE = {1: "memory.usage_in_bytes", 2: "memory.current"}
LIMIT = {1: "memory.limit_in_bytes", 2: "memory.max"}
# (directory below /sys/fs/cgroup, version) of the memory controller, v1 (hybrid) first.
HIERARCHIES = (("memory", 1), ("", 2), ("unified", 2))
STAT_KEYS = frozenset(  # what read_files parses of memory.stat (v1's and v2's)
    "inactive_file shmem swap hierarchical_memory_limit total_inactive_file "
    "total_shmem total_swap".split()
)


def parse_flat_keyed(text: str, keys=None) -> Dict[str, int]:
    """'anon 123\\nfile 456' (memory.stat, .events, oom_control) -> dict, of `keys` if given."""
    values: Dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and (keys is None or parts[0] in keys):
            with suppress(ValueError):
                values[parts[0]] = int(parts[1])
    return values


def parse_limit(text: str) -> Optional[int]:
    number = V1_UNLIMITED if text.strip() == "max" else int(text)
    return None if number >= V1_UNLIMITED else number


def read_value(directory: str, name: str, parse=parse_limit, missing=None):
    """`missing` when the cgroup has no such file (a root, an older kernel, no swap accounting)."""
    with suppress(FileNotFoundError):
        return parse(read_text(os.path.join(directory, name)))
    return missing


def limits_above(level: str, name: str, above: Dict[str, list]) -> list:
    """(directory, limit) of each cgroup above `level` up to the top of what is mounted,
    memoized in `above` (node mode's pods share their QoS slices: read once a pass)."""
    parent = os.path.dirname(os.path.normpath(level))  # a ns root: ".../cgroup/"
    if parent not in above:
        top = parent == level or not os.path.exists(os.path.join(parent, name))
        above[parent] = [] if top else [(parent, read_value(parent, name))]
        above[parent] += [] if top else limits_above(parent, name, above)
    return above[parent]


def effective_limit(directory: str, version: int, above=None) -> tuple:
    """-> (limit, where): the smallest limit from the cgroup up, as the kernel enforces it (v2
    has no hierarchical_memory_limit; a pod-level limit, KEP-2837, is on the pod's cgroup
    alone), and where it binds: "pod", "self", "ancestor" or "none"; of equal limits the
    outermost (a container as tight as its pod is read as the pod)."""
    name = LIMIT[version]
    best, where = None, "none"
    chain = limits_above(directory, name, {} if above is None else above)
    for level, limit in [(directory, read_value(directory, name)), *chain]:
        if limit is not None and (best is None or limit <= best):
            best, where = limit, "ancestor"
            if POD_CGROUP_DIR.search(os.path.basename(level)):
                where = "pod"
            elif level == directory:
                where = "self"
    return best, where


def read_files(directory: str, version: int, above=None, with_swap=True) -> dict:
    """A cgroup's files as CgroupMemory's fields by name (all but path, version and pod)."""
    stat = parse_flat_keyed(read_text(f"{directory}/memory.stat"), STAT_KEYS)
    # v1's total_* fields include descendants (use_hierarchy, always on since 5.x).
    stat.update({k[6:]: v for k, v in list(stat.items()) if k.startswith("total_")})
    limit, where = effective_limit(directory, version, above)
    usage = int(read_text(os.path.join(directory, USAGE[version])))
    high, swap, swap_limit = None, stat.get("swap"), None
    if version == 2:
        events = read_value(directory, "memory.events", parse_flat_keyed, {})
        high = read_value(directory, "memory.high")
        swap = None  # a node without swap: not read, not exported
        if with_swap:
            swap = read_value(directory, "memory.swap.current")
            swap_limit = read_value(directory, "memory.swap.max")
    else:
        # Above what this namespace mounts, memory.stat still knows the tightest limit.
        hierarchical = stat.get("hierarchical_memory_limit", V1_UNLIMITED)
        if hierarchical < V1_UNLIMITED and (limit is None or hierarchical < limit):
            limit, where = hierarchical, "ancestor"
        control = read_value(directory, "memory.oom_control", parse_flat_keyed, {})
        failcnt = read_value(directory, "memory.failcnt")  # hits of the limit: v2's max
        events = {"oom_kill": control.get("oom_kill"), "max": failcnt}
        events = {k: v for k, v in events.items() if v is not None}
    return dict(
        usage_bytes=usage,
        limit_bytes=limit,
        limit_source=where,
        working_set_bytes=max(0, usage - stat.get("inactive_file", 0)),
        shmem_bytes=stat.get("shmem"),
        oom_kills=events.get("oom_kill"),
        high_bytes=high,
        events=tuple(sorted(events.items())),
        swap_bytes=swap,
        swap_limit_bytes=swap_limit,
    )


def below(path: str, root: str) -> Optional[List[str]]:
    """`path`'s components below `root`, both relative to one cgroup namespace root (either may
    climb out of it with leading '..'); None when `path` is not at or below `root`."""
    above = "/\0" * 64 + "/"  # stand-ins for directories above the namespace root
    p, r = (os.path.normpath(above + t).split("/")[1:] for t in (path, root))
    if p[: len(r)] != r or any(part.startswith("\0") for part in p[len(r) :]):
        # Not below the mount, or below it through directories whose names this namespace
        # cannot tell (a v2 path /../<id> under a mount rooted at /../..): not guessed.
        return None
    return p[len(r) :]


def cgroup_directories(entries: Iterable[MountEntry], path: str, version: int) -> list:
    """Every directory a mounted cgroupfs shows `path` at (v1: a memory hierarchy; v2: cgroup2):
    /proc/<pid>/cgroup is relative to the cgroup namespace's root, a mount shows the subtree
    below its mountinfo root (e.g. the host's cgroupfs given read-only to a sidecar)."""
    out = []
    for entry in entries:
        v1 = entry.fstype == "cgroup" and "memory" in entry.options.split(",")
        rest = below(path, entry.root)
        if rest is not None and (v1 if version == 1 else entry.fstype == "cgroup2"):
            out.append(os.path.join(entry.mount_point, *rest))
    return out
